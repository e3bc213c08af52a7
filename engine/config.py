"""Experiment configs: load, validate against a small schema, resolve paths.

Every message names the file and the JSON path, e.g.
`experiments/x.json: optim.lr: must be > 0, got -1`. Unknown keys are errors, so a typo such as
`lerning_rate` is never silently ignored. The result is a plain nested dict (JSON-serialisable, so
it is written as the run's `config.json` and into every checkpoint) with absolute paths.
"""

from __future__ import annotations

import glob
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.errors import UserError

BUILTIN_SOURCES = ("python-reference", "stdlib-docstrings", "stdlib-code")
PRECISIONS = ("fp32", "bf16", "fp16")
SOURCE_FORMATS = ("auto", "text", "jsonl")
BANDIT_SCORES = ("progress", "loss")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class ConfigError(UserError):
    """A config problem, already formatted as `file: json.path: message`."""


# ---------------------------------------------------------------- the schema language


@dataclass
class Num:
    kind: type  # int or float
    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None
    default: Any = None

    def check(self, value: Any, where: str, fail: Callable[[str, str], None]) -> Any:
        orig = value
        is_bool = isinstance(value, bool)
        if self.kind is int and (is_bool or not isinstance(value, int)):
            fail(where, f"must be an integer, got {value!r}")
        if self.kind is float:
            if is_bool or not isinstance(value, (int, float)):
                fail(where, f"must be a number, got {value!r}")
            if not math.isfinite(value):
                fail(where, f"must be finite, got {value!r}")
            value = float(value)
        for bound, ok, word in (
            (self.gt, lambda b: value > b, ">"),
            (self.ge, lambda b: value >= b, ">="),
            (self.lt, lambda b: value < b, "<"),
            (self.le, lambda b: value <= b, "<="),
        ):
            if bound is not None and not ok(bound):
                fail(where, f"must be {word} {bound:g}, got {orig!r}")
        return value


@dataclass
class Str:
    choices: tuple[str, ...] | None = None
    pattern: re.Pattern[str] | None = None
    nonempty: bool = True
    default: Any = None

    def check(self, value: Any, where: str, fail: Callable[[str, str], None]) -> Any:
        if not isinstance(value, str):
            fail(where, f"must be a string, got {value!r}")
        if self.nonempty and not value:
            fail(where, "must not be empty")
        if self.choices is not None and value not in self.choices:
            fail(where, f"must be one of {', '.join(self.choices)}; got {value!r}")
        if self.pattern is not None and not self.pattern.match(value):
            fail(where, f"must match {self.pattern.pattern}, got {value!r}")
        return value


@dataclass
class List:
    item: Any
    min_len: int = 0
    max_len: int | None = None
    default: Any = None

    def check(self, value: Any, where: str, fail: Callable[[str, str], None]) -> Any:
        if not isinstance(value, list):
            fail(where, f"must be a list, got {type(value).__name__}")
        if len(value) < self.min_len:
            fail(where, f"must have at least {self.min_len} item(s), got {len(value)}")
        if self.max_len is not None and len(value) > self.max_len:
            fail(where, f"must have at most {self.max_len} items, got {len(value)}")
        return [self.item.check(v, f"{where}[{i}]", fail) for i, v in enumerate(value)]


@dataclass
class Obj:
    fields: dict[str, Any]
    optional: frozenset[str] = field(default_factory=frozenset)
    default: Any = None

    def check(self, value: Any, where: str, fail: Callable[[str, str], None]) -> Any:
        if not isinstance(value, dict):
            fail(where, f"must be an object, got {type(value).__name__}")
        for key in value:
            if key not in self.fields:
                near = _closest(key, self.fields)
                hint = f" (did you mean {near!r}?)" if near else ""
                fail(_join(where, key), f"unknown key{hint}; allowed: {', '.join(self.fields)}")
        out = {}
        for key, spec in self.fields.items():
            if key in value:
                out[key] = spec.check(value[key], _join(where, key), fail)
            elif key in self.optional:
                if spec.default is not None:
                    out[key] = spec.default
            else:
                fail(_join(where, key), "missing (required)")
        return out


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _closest(key: str, options: dict[str, Any]) -> str | None:
    import difflib

    match = difflib.get_close_matches(key, list(options), n=1, cutoff=0.6)
    return match[0] if match else None


# ---------------------------------------------------------------- the experiment schema

SOURCE = Obj(
    {
        "name": Str(pattern=_NAME_RE),
        "builtin": Str(choices=BUILTIN_SOURCES),
        "paths": List(Str(), min_len=1),
        "format": Str(choices=SOURCE_FORMATS, default="auto"),
    },
    optional=frozenset({"builtin", "paths", "format"}),
)

SCHEMA = Obj(
    {
        "name": Str(pattern=_NAME_RE),
        "description": Str(nonempty=False, default=""),
        "model": Obj(
            {
                "n_layer": Num(int, ge=1, le=256),
                "d_model": Num(int, ge=1, le=65536),
                "n_head": Num(int, ge=1, le=1024),
                "d_ff": Num(int, ge=1, le=262144),
                "vocab_size": Num(int, ge=2, le=65536),
                "seq_len": Num(int, ge=1, le=65536),
            }
        ),
        "train": Obj(
            {
                "batch_size": Num(int, ge=1, le=65536),
                "grad_accum": Num(int, ge=1, le=65536),
                "max_steps": Num(int, ge=1, le=2**31 - 1),
                "precision": Str(choices=PRECISIONS),
                "seed": Num(int, ge=0, le=2**63 - 1),
            }
        ),
        "optim": Obj(
            {
                "lr": Num(float, gt=0, le=10),
                "warmup_steps": Num(int, ge=0),
                "min_lr_frac": Num(float, ge=0, le=1),
                "betas": List(Num(float, ge=0, lt=1), min_len=2, max_len=2),
                "eps": Num(float, gt=0, lt=1),
                "weight_decay": Num(float, ge=0, lt=10),
                "max_grad_norm": Num(float, gt=0),
            }
        ),
        "data": Obj(
            {
                "dir": Str(),
                "tokenizer": Obj(
                    {
                        "path": Str(),
                        "vocab_size": Num(int, ge=257, le=65536),
                        "train_bytes": Num(int, ge=1024),
                    }
                ),
                "sources": List(SOURCE, min_len=1, max_len=64),
            }
        ),
        "bandit": Obj(
            {
                "phase_lengths": List(Num(int, ge=1, le=100000), min_len=1),
                "eta": Num(float, ge=0, le=100),
                "floor": Num(float, ge=0, lt=1),
                "score": Str(choices=BANDIT_SCORES, default="progress"),
                "seed": Num(int, ge=0, le=2**63 - 1),
            },
            optional=frozenset({"score"}),
        ),
        "checkpoint": Obj({"every": Num(int, ge=1), "keep": Num(int, ge=1)}),
        "samples": Obj(
            {
                "every_steps": Num(int, ge=0),
                "prompts": List(Str(), min_len=1),
                "length": Num(int, ge=1, le=65536),
                "top_k": Num(int, ge=1),
                "temperature": Num(float, gt=0, le=100),
            }
        ),
    },
    optional=frozenset({"description"}),
)


# ---------------------------------------------------------------- loading


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def parse_config(raw: Any, origin: str, base_dir: Path) -> dict[str, Any]:
    """Validate an already-parsed config object; `origin` names it in messages."""

    def fail(where: str, msg: str) -> None:
        raise ConfigError(f"{origin}: {where}: {msg}" if where else f"{origin}: {msg}")

    cfg = SCHEMA.check(raw, "", fail)
    _check_relations(cfg, fail)
    _resolve_paths(cfg, base_dir, fail)
    return cfg


def load_config(path: str | Path) -> dict[str, Any]:
    """Read, validate and resolve an experiment config; raises ConfigError (exit status 2)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, expected a JSON config file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read: {e}") from None
    try:
        raw = json.loads(text, object_pairs_hook=_no_duplicate_keys)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: line {e.lineno} column {e.colno}: invalid JSON: {e.msg}") from None
    except ValueError as e:
        raise ConfigError(f"{path}: invalid JSON: {e}") from None
    cfg = parse_config(raw, str(path), p.resolve().parent)
    cfg["_path"] = str(p.resolve())
    return cfg


def _check_relations(cfg: dict[str, Any], fail: Callable[[str, str], None]) -> None:
    m = cfg["model"]
    if m["d_model"] % m["n_head"] != 0:
        fail("model.n_head", f"must divide d_model ({m['d_model']}), got {m['n_head']}")
    tok_v = cfg["data"]["tokenizer"]["vocab_size"]
    if m["vocab_size"] != tok_v:
        fail("model.vocab_size", f"must equal data.tokenizer.vocab_size ({tok_v}), got {m['vocab_size']}")
    sources = cfg["data"]["sources"]
    seen: set[str] = set()
    for i, src in enumerate(sources):
        where = f"data.sources[{i}]"
        if ("builtin" in src) == ("paths" in src):
            fail(where, "needs exactly one of 'builtin' or 'paths'")
        if src["name"] in seen:
            fail(f"{where}.name", f"duplicate source name {src['name']!r}")
        seen.add(src["name"])
        if "builtin" in src and src.get("format", "auto") != "auto":
            fail(f"{where}.format", "applies only to 'paths' sources")
    b = cfg["bandit"]
    if len(sources) * b["floor"] >= 1:
        fail("bandit.floor", f"times the number of sources ({len(sources)}) must be < 1, got {b['floor']}")
    if len(set(b["phase_lengths"])) != len(b["phase_lengths"]):
        fail("bandit.phase_lengths", f"must not repeat a length, got {b['phase_lengths']}")
    s = cfg["samples"]
    if s["top_k"] > m["vocab_size"]:
        fail("samples.top_k", f"must be <= model.vocab_size ({m['vocab_size']}), got {s['top_k']}")


def _resolve_paths(cfg: dict[str, Any], base: Path, fail: Callable[[str, str], None]) -> None:
    data = cfg["data"]
    data_dir = (base / data["dir"]).resolve()
    data["dir"] = str(data_dir)
    tok = data["tokenizer"]
    tok["path"] = str((data_dir / tok["path"]).resolve())
    if Path(tok["path"]).is_file():
        n = tokenizer_vocab_size(Path(tok["path"]))
        if n is None:
            fail("data.tokenizer.path", f"{tok['path']} is not a tokenizer JSON file")
        elif n != tok["vocab_size"]:
            fail("data.tokenizer.vocab_size", f"tokenizer at {tok['path']} has {n} ids, config says {tok['vocab_size']}")
    for i, src in enumerate(data["sources"]):
        if "paths" not in src:
            continue
        resolved = []
        for j, raw in enumerate(src["paths"]):
            p = Path(raw).expanduser()
            full = str(p if p.is_absolute() else base / p)
            if not (Path(full).exists() or glob.glob(full, recursive=True)):
                fail(f"data.sources[{i}].paths[{j}]", f"{raw!r} matches no file (looked for {full})")
            resolved.append(full)
        src["paths"] = resolved


def tokenizer_vocab_size(path: Path) -> int | None:
    """Number of ids in a HF tokenizer JSON (model vocab plus added tokens), or None if foreign."""
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
        ids = set(obj["model"]["vocab"].values())
        ids.update(t["id"] for t in obj.get("added_tokens", []))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return len(ids)
