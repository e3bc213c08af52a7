"""Experiment configs: typed, validated, with resolved paths.

A config is a tree of frozen dataclasses (`Config` at the root). Each field declares its type and
its range once, beside its name (`spec(...)`); the loader walks those declarations, so every
message names the file and the JSON path, e.g. `experiments/x.json: optim.lr: must be > 0, got
-1`. Unknown keys are errors, so a typo such as `lerning_rate` is never silently ignored. Paths
come out absolute. `Config.to_json()` gives the JSON written as the run's `config.json` and into
every checkpoint; that JSON loads back into an equal `Config`.
"""

from __future__ import annotations

import dataclasses
import difflib
import glob
import math
import os
import re
import stat
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

from engine import jsonio
from engine.errors import UserError

BUILTIN_SOURCES = ("python-reference", "stdlib-docstrings", "stdlib-code")
# fp8: the linear maps' GEMMs on FP8 values (model/fp8.py)
PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
ATTENTIONS = ("auto", "cudnn", "classic")  # gpu.attention
SOURCE_FORMATS = ("auto", "text", "docs", "gutenberg", "jsonl")
BANDIT_SCORES = ("progress", "loss")
TOKENIZER_BYTES = 64 << 20  # an 8449-id BPE tokenizer is about 0.5 MB
DESCRIPTION_MAX = 4096  # characters: a description travels into every checkpoint's state.json
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")

Fail = Callable[[str, str], None]


class ConfigError(UserError):
    """A config problem, already formatted as `file: json.path: message`."""


# ---------------------------------------------------------------- value checks


@dataclass(frozen=True)
class Num:
    kind: type  # int or float
    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None

    def check(self, value: Any, where: str, fail: Fail) -> Any:
        orig = value
        is_bool = isinstance(value, bool)
        if self.kind is int and (is_bool or not isinstance(value, int)):
            fail(where, f"must be an integer, got {_short(value)}")
        if self.kind is float:
            if is_bool or not isinstance(value, (int, float)):
                fail(where, f"must be a number, got {_short(value)}")
            try:
                value = float(value)
            except OverflowError:
                fail(where, f"must be finite, got {_short(orig)}")
            if not math.isfinite(value):
                fail(where, f"must be finite, got {_short(orig)}")
        for bound, word in ((self.gt, ">"), (self.ge, ">="), (self.lt, "<"), (self.le, "<=")):
            if bound is None:
                continue
            ok = {">": value > bound, ">=": value >= bound, "<": value < bound,
                  "<=": value <= bound}[word]
            if not ok:
                fail(where, f"must be {word} {bound:g}, got {_short(orig)}")
        return value


@dataclass(frozen=True)
class Str:
    choices: tuple[str, ...] | None = None
    pattern: re.Pattern[str] | None = None
    nonempty: bool = True
    max_len: int = 4096

    def check(self, value: Any, where: str, fail: Fail) -> Any:
        if not isinstance(value, str):
            fail(where, f"must be a string, got {_short(value)}")
        if self.nonempty and not value:
            fail(where, "must not be empty")
        if len(value) > self.max_len:
            fail(where, f"must be at most {self.max_len} characters, got {len(value)}")
        if self.choices is not None and value not in self.choices:
            fail(where, f"must be one of {', '.join(self.choices)}; got {_short(value)}")
        if self.pattern is not None and not self.pattern.match(value):
            fail(where, f"must match {self.pattern.pattern}, got {_short(value)}")
        return value


@dataclass(frozen=True)
class Bool:
    def check(self, value: Any, where: str, fail: Fail) -> Any:
        if not isinstance(value, bool):
            fail(where, f"must be true or false, got {_short(value)}")
        return value


@dataclass(frozen=True)
class List:
    item: Any
    min_len: int = 0
    max_len: int = 4096

    def check(self, value: Any, where: str, fail: Fail) -> Any:
        if not isinstance(value, list):
            fail(where, f"must be a list, got {type(value).__name__}")
        if len(value) < self.min_len:
            fail(where, f"must have at least {self.min_len} item(s), got {len(value)}")
        if len(value) > self.max_len:
            fail(where, f"must have at most {self.max_len} items, got {len(value)}")
        return tuple(self.item.check(v, f"{where}[{i}]", fail) for i, v in enumerate(value))


@dataclass(frozen=True)
class Section:
    """A nested object read into the dataclass `cls` (its fields declare their own checks)."""

    cls: type

    def check(self, value: Any, where: str, fail: Fail) -> Any:
        return _build(self.cls, value, where, fail)


def spec(check: Any, default: Any = MISSING) -> Any:
    """A config field: its check (type and range) and, for an optional key, its default."""
    return field(default=default, metadata={"check": check})


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _build(cls: type, value: Any, where: str, fail: Fail) -> Any:
    """Check `value` (a JSON object) against the fields of dataclass `cls` and build it."""
    if not isinstance(value, dict):
        fail(where, f"must be an object, got {type(value).__name__}")
    declared = {f.name: f for f in fields(cls)}
    for key in value:
        if key not in declared:
            near = difflib.get_close_matches(str(key), list(declared), n=1, cutoff=0.6)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            fail(_join(where, str(key)[:60]),
                 f"unknown key{hint}; allowed: {', '.join(declared)}")
    kwargs = {}
    for name, f in declared.items():
        if name in value:
            kwargs[name] = f.metadata["check"].check(value[name], _join(where, name), fail)
        elif f.default is MISSING:
            fail(_join(where, name), "missing (required)")
    return cls(**kwargs)


def _to_json(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: _to_json(getattr(obj, f.name)) for f in fields(obj)
                if getattr(obj, f.name) is not None}
    if isinstance(obj, tuple):
        return [_to_json(x) for x in obj]
    return obj


# ---------------------------------------------------------------- the experiment config


@dataclass(frozen=True)
class ModelConfig:
    n_layer: int = spec(Num(int, ge=1, le=256))
    d_model: int = spec(Num(int, ge=1, le=65536))
    n_head: int = spec(Num(int, ge=1, le=1024))
    d_ff: int = spec(Num(int, ge=1, le=262144))
    vocab_size: int = spec(Num(int, ge=2, le=65536))
    seq_len: int = spec(Num(int, ge=1, le=65536))


@dataclass(frozen=True)
class TrainConfig:
    batch_size: int = spec(Num(int, ge=1, le=65536))
    grad_accum: int = spec(Num(int, ge=1, le=65536))
    max_steps: int = spec(Num(int, ge=1, le=2**31 - 1))
    precision: str = spec(Str(choices=PRECISIONS))
    seed: int = spec(Num(int, ge=0, le=2**63 - 1))

    @property
    def rows_per_step(self) -> int:
        return self.batch_size * self.grad_accum


@dataclass(frozen=True)
class OptimConfig:
    lr: float = spec(Num(float, gt=0, le=10))
    warmup_steps: int = spec(Num(int, ge=0, le=2**31 - 1))
    min_lr_frac: float = spec(Num(float, ge=0, le=1))
    betas: tuple[float, float] = spec(List(Num(float, ge=0, lt=1), min_len=2, max_len=2))
    eps: float = spec(Num(float, gt=0, lt=1))
    weight_decay: float = spec(Num(float, ge=0, lt=10))
    max_grad_norm: float = spec(Num(float, gt=0))


@dataclass(frozen=True)
class TokenizerConfig:
    path: str = spec(Str())
    vocab_size: int = spec(Num(int, ge=257, le=65536))
    train_bytes: int = spec(Num(int, ge=1024, le=2**40))


@dataclass(frozen=True)
class SourceConfig:
    """A named data arm: a built-in one, or local files (`paths`) in `format`."""

    name: str = spec(Str(pattern=_NAME_RE, max_len=64))
    builtin: str | None = spec(Str(choices=BUILTIN_SOURCES), None)
    paths: tuple[str, ...] | None = spec(List(Str(), min_len=1), None)
    format: str = spec(Str(choices=SOURCE_FORMATS), "auto")


@dataclass(frozen=True)
class DataConfig:
    dir: str = spec(Str())
    tokenizer: TokenizerConfig = spec(Section(TokenizerConfig))
    sources: tuple[SourceConfig, ...] = spec(List(Section(SourceConfig), min_len=1, max_len=64))

    @property
    def source_names(self) -> list[str]:
        return [s.name for s in self.sources]


@dataclass(frozen=True)
class BanditConfig:
    phase_lengths: tuple[int, ...] = spec(List(Num(int, ge=1, le=100000), min_len=1, max_len=64))
    eta: float = spec(Num(float, ge=0, le=100))
    floor: float = spec(Num(float, ge=0, lt=1))
    seed: int = spec(Num(int, ge=0, le=2**63 - 1))
    score: str = spec(Str(choices=BANDIT_SCORES), "progress")


@dataclass(frozen=True)
class CheckpointConfig:
    """`every` steps a periodic checkpoint, of which the newest `keep` stay; snapshot and stop
    checkpoints (the `s` and `q` keys) are all kept unless `keep_manual` bounds them."""

    every: int = spec(Num(int, ge=1, le=2**31 - 1))
    keep: int = spec(Num(int, ge=1, le=100000))
    keep_manual: int | None = spec(Num(int, ge=1, le=100000), None)


@dataclass(frozen=True)
class SamplesConfig:
    every_steps: int = spec(Num(int, ge=0, le=2**31 - 1))
    prompts: tuple[str, ...] = spec(List(Str(max_len=1024), min_len=1, max_len=64))
    length: int = spec(Num(int, ge=1, le=65536))
    top_k: int = spec(Num(int, ge=1, le=65536))
    temperature: float = spec(Num(float, gt=0, le=100))


@dataclass(frozen=True)
class EvalConfig:
    """Validation: the last `holdout` share of every source's tokens is kept out of training
    (engine.data.sampler), and every `every_steps` steps the loss over `batches` batches of
    `train.batch_size` held-out windows of each source is written to eval.jsonl."""

    every_steps: int = spec(Num(int, ge=1, le=2**31 - 1))
    batches: int = spec(Num(int, ge=1, le=1024), 4)
    holdout: float = spec(Num(float, gt=0, le=0.5), 0.05)


@dataclass(frozen=True)
class AlertsConfig:
    """How the engine's alerts (engine.run.alerts) are raised and passed on. `command`: argv of
    a program run with each alert as JSON on its stdin (a webhook, a desktop notification),
    killed after `timeout_s`; a stall is `stall_factor` times the median step time without a
    step, and at least `stall_min_s` seconds.

    A spike is `spike_mads` robust standard deviations above what is expected; a kind that
    alerted is quiet for `cooldown_steps` steps, unless a value `breakthrough` times as far off
    comes. The run is diverging when its loss is `diverge_margin` nats above ln(vocab_size)
    (the loss of a uniform guess), or `start_factor` times its first loss for two steps, or
    `jump_factor` times its smoothed loss for two steps, or when the median of its last
    `rise_steps` losses stays `rise_sigmas` noise SDs (at least 5%) above its best smoothed
    loss. The health says `warning` until `quiet_steps` steps pass without an alert."""

    command: tuple[str, ...] | None = spec(List(Str(), min_len=1, max_len=64), None)
    timeout_s: float = spec(Num(float, gt=0, le=3600), 10.0)
    stall_factor: float = spec(Num(float, gt=1, le=1e6), 20.0)
    stall_min_s: float = spec(Num(float, gt=0, le=86400), 60.0)
    spike_mads: float = spec(Num(float, gt=0, le=1e6), 8.0)
    cooldown_steps: int = spec(Num(int, ge=0, le=2**31 - 1), 50)
    breakthrough: float = spec(Num(float, gt=1, le=1e6), 2.0)
    diverge_margin: float = spec(Num(float, ge=0, le=1e6), 1.0)
    start_factor: float = spec(Num(float, gt=1, le=1e6), 2.0)
    jump_factor: float = spec(Num(float, gt=1, le=1e6), 3.0)
    rise_sigmas: float = spec(Num(float, gt=0, le=1e6), 3.0)
    rise_steps: int = spec(Num(int, ge=1, le=100000), 5)
    quiet_steps: int = spec(Num(int, ge=1, le=2**31 - 1), 100)


@dataclass(frozen=True)
class GpuConfig:
    """How the CUDA backend computes: choices that change a run's bits, so they are part of the
    experiment (a run records them with its config and a resume computes with the run's own).
    The numpy backend ignores them. Where the GPU cannot honour one (cuDNN missing, a shape it
    refuses, the flex library not built), the backend falls back and engine.log says so.

    `attention`: cuDNN's fused flash attention (`cudnn`), the engine's own chunked GEMMs and
    softmax (`classic`), or `auto`: cuDNN where it is installed and accepts the model, else the
    classic one (`--attention` overrides it). `flex_backward`: the flex deterministic attention
    backward in place of cuDNN's, where it runs (Hopper, head dim 64, seq_len a multiple of
    128, its library built). `qkv_rows`: Q, K and V side by side in the rows of one [R, 3d]
    matrix, one GEMM each way, where cuDNN takes them so. `logits_low_precision`: the training
    logits in the compute precision (bf16, fp16). `grads_low_precision`: the layers' weight
    gradients in bf16 where a bf16 or fp8 step writes them. `attention_chunk`: the classic attention's
    queries per causal chunk (its GEMMs' shapes). `gemm_tune`: time cuBLASLt's best
    `gemm_candidates` proposals for each GEMM at start and keep the fastest (else its first
    choice; the run directory's gemm_plan.json keeps the choices either way). `fusions`: the
    fused one-graph step (false: the unfused reference path, plain cuBLAS, separate kernels and
    the optimizer launched from the host), and there `gelu_in_gemm`: GELU in the MLP GEMMs'
    epilogues. `ddp_overlap`: a data-parallel step sums each layer's gradients over the ranks as
    the backward completes them, inside its graph (false: one all-reduce after the backward)."""

    attention: str = spec(Str(choices=ATTENTIONS), "auto")
    flex_backward: bool = spec(Bool(), True)
    qkv_rows: bool = spec(Bool(), True)
    logits_low_precision: bool = spec(Bool(), True)
    grads_low_precision: bool = spec(Bool(), True)
    attention_chunk: int = spec(Num(int, ge=1, le=2**31 - 1), 256)
    gemm_tune: bool = spec(Bool(), True)
    gemm_candidates: int = spec(Num(int, ge=1, le=64), 8)
    fusions: bool = spec(Bool(), True)
    gelu_in_gemm: bool = spec(Bool(), True)
    ddp_overlap: bool = spec(Bool(), True)


@dataclass(frozen=True)
class Config:
    """One experiment: the model, how to train it, on what data, and what to record."""

    name: str = spec(Str(pattern=_NAME_RE, max_len=128))
    model: ModelConfig = spec(Section(ModelConfig))
    train: TrainConfig = spec(Section(TrainConfig))
    optim: OptimConfig = spec(Section(OptimConfig))
    data: DataConfig = spec(Section(DataConfig))
    bandit: BanditConfig = spec(Section(BanditConfig))
    checkpoint: CheckpointConfig = spec(Section(CheckpointConfig))
    samples: SamplesConfig = spec(Section(SamplesConfig))
    eval: EvalConfig | None = spec(Section(EvalConfig), None)  # off when absent
    alerts: AlertsConfig | None = spec(Section(AlertsConfig), None)  # the defaults when absent
    description: str = spec(Str(nonempty=False, max_len=DESCRIPTION_MAX), "")
    # absent: every field's default; written out whole, so that a run keeps its own
    gpu: GpuConfig = spec(Section(GpuConfig), GpuConfig())

    def to_json(self) -> dict[str, Any]:
        """The JSON object of this config (what config.json and checkpoints hold)."""
        return _to_json(self)

    def with_precision(self, precision: str) -> Config:
        """The same experiment in another train.precision (one of PRECISIONS)."""
        if precision not in PRECISIONS:
            raise UserError(f"precision: expected one of {', '.join(PRECISIONS)}, got "
                            f"{precision!r}")
        return dataclasses.replace(self, train=dataclasses.replace(self.train,
                                                                   precision=precision))

    def with_attention(self, attention: str) -> Config:
        """The same experiment with another gpu.attention (one of ATTENTIONS)."""
        if attention not in ATTENTIONS:
            raise UserError(f"--attention: expected one of {', '.join(ATTENTIONS)}, got "
                            f"{attention!r}")
        return dataclasses.replace(self, gpu=dataclasses.replace(self.gpu, attention=attention))

    def with_max_steps(self, max_steps: int) -> Config:
        """The same experiment trained to `max_steps` (the lr schedule follows)."""
        return dataclasses.replace(self, train=dataclasses.replace(self.train,
                                                                   max_steps=max_steps))

    @property
    def tokens_per_step(self) -> int:
        return self.train.rows_per_step * self.model.seq_len


# ---------------------------------------------------------------- loading


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def parse_config(raw: Any, origin: str, base_dir: Path | str, *,
                 check_paths: bool = True) -> Config:
    """Validate an already-parsed config object; `origin` names it in messages, relative paths
    are taken from `base_dir`. `check_paths=False` reads a config for display only (a run
    directory copied from another machine): its data paths need not exist here."""

    def fail(where: str, msg: str) -> None:
        raise ConfigError(f"{origin}: {where}: {msg}" if where else f"{origin}: {msg}")

    cfg = _build(Config, raw, "", fail)
    _check_relations(cfg, fail)
    return _resolve_paths(cfg, Path(base_dir), fail) if check_paths else cfg


def load_config(path: str | Path) -> Config:
    """Read, validate and resolve an experiment config; raises ConfigError (exit status 2).

    The config may come through a pipe (`andrea-train <(cat cfg.json)`): it is read to its end
    (engine.infile.PIPE_WAIT_S at most), and its relative paths are taken from the current
    directory. Any other non-regular file (a FIFO nobody writes to, a device) is refused."""
    p = Path(path)
    try:
        piped = stat.S_ISFIFO(os.stat(p).st_mode)
    except OSError:
        piped = False  # load_file says what is wrong
    try:
        raw = jsonio.load_file(p, max_bytes=jsonio.CONFIG_BYTES,
                               object_pairs_hook=_no_duplicate_keys, pipe_ok=True)
    except jsonio.JsonError as e:
        raise ConfigError(str(e)) from None
    return parse_config(raw, str(path), Path.cwd() if piped else p.resolve().parent)


def config_from_bytes(data: bytes, origin: str, base_dir: Path | str) -> Config:
    """`load_config` of a config already read (a pipe gives its bytes once): `origin` names it
    in messages, relative paths are taken from `base_dir`; raises ConfigError (exit status 2)."""
    try:
        raw = jsonio.loads(data, origin, max_bytes=jsonio.CONFIG_BYTES,
                           object_pairs_hook=_no_duplicate_keys)
    except jsonio.JsonError as e:
        raise ConfigError(str(e)) from None
    return parse_config(raw, origin, base_dir)


def _check_relations(cfg: Config, fail: Fail) -> None:
    m = cfg.model
    if m.d_model % m.n_head != 0:
        fail("model.n_head", f"must divide d_model ({m.d_model}), got {m.n_head}")
    tok_v = cfg.data.tokenizer.vocab_size
    if m.vocab_size != tok_v:
        fail("model.vocab_size", f"must equal data.tokenizer.vocab_size ({tok_v}), got {m.vocab_size}")
    seen: set[str] = set()
    for i, src in enumerate(cfg.data.sources):
        where = f"data.sources[{i}]"
        if (src.builtin is None) == (src.paths is None):
            fail(where, "needs exactly one of 'builtin' or 'paths'")
        if src.name in seen:
            fail(f"{where}.name", f"duplicate source name {src.name!r}")
        seen.add(src.name)
        if src.builtin is not None and src.format != "auto":
            fail(f"{where}.format", "applies only to 'paths' sources")
    b = cfg.bandit
    n_src = len(cfg.data.sources)
    if n_src * b.floor >= 1:
        fail("bandit.floor", f"times the number of sources ({n_src}) must be < 1, got {b.floor}")
    if len(set(b.phase_lengths)) != len(b.phase_lengths):
        fail("bandit.phase_lengths", f"must not repeat a length, got {list(b.phase_lengths)}")
    if cfg.samples.top_k > m.vocab_size:
        fail("samples.top_k", f"must be <= model.vocab_size ({m.vocab_size}), got {cfg.samples.top_k}")
    if cfg.train.precision == "fp8" and not cfg.gpu.fusions:
        fail("gpu.fusions", "must be true with train.precision fp8 (the FP8 GEMMs are the "
                            "fused path's), got false")


def _resolve_paths(cfg: Config, base: Path, fail: Fail) -> Config:
    data = cfg.data
    data_dir = (base / data.dir).resolve()
    tok = dataclasses.replace(data.tokenizer, path=str((data_dir / data.tokenizer.path).resolve()))
    if Path(tok.path).is_file():
        n = tokenizer_vocab_size(Path(tok.path))
        if n is None:
            fail("data.tokenizer.path", f"{tok.path} is not a tokenizer JSON file")
        elif n != tok.vocab_size:
            fail("data.tokenizer.vocab_size",
                 f"tokenizer at {tok.path} has {n} ids, config says {tok.vocab_size}")
    sources = []
    for i, src in enumerate(data.sources):
        if src.paths is not None:
            resolved = []
            for j, raw in enumerate(src.paths):
                p = Path(raw).expanduser()
                full = str(p if p.is_absolute() else base / p)
                if not (Path(full).exists() or glob.glob(full, recursive=True)):
                    fail(f"data.sources[{i}].paths[{j}]",
                         f"{raw!r} matches no file (looked for {full})")
                resolved.append(full)
            src = dataclasses.replace(src, paths=tuple(resolved))
        sources.append(src)
    new_data = dataclasses.replace(data, dir=str(data_dir), tokenizer=tok, sources=tuple(sources))
    return dataclasses.replace(cfg, data=new_data)


def tokenizer_vocab_size(path: Path) -> int | None:
    """Number of ids in a HF tokenizer JSON (model vocab plus added tokens), or None if foreign."""
    try:
        obj = jsonio.load_file(path, max_bytes=TOKENIZER_BYTES)
        ids = set(obj["model"]["vocab"].values())
        ids.update(t["id"] for t in obj.get("added_tokens", []))
    except (jsonio.JsonError, KeyError, TypeError, AttributeError):
        return None
    return len(ids)


def config_diff(old: Config, new: Config) -> list[tuple[str, Any, Any]]:
    """(dotted key, old value, new value) for every leaf that differs between two configs."""
    out: list[tuple[str, Any, Any]] = []

    def walk(a: Any, b: Any, prefix: str) -> None:
        if isinstance(a, dict) and isinstance(b, dict):
            for k in sorted(set(a) | set(b)):
                walk(a.get(k), b.get(k), f"{prefix}{k}.")
        elif a != b:
            out.append((prefix[:-1], a, b))

    walk(old.to_json(), new.to_json(), "")
    return out


# ---------------------------------------------------------------- checkpoints before the gpu section

# A checkpoint written before the config had a gpu section kept the CUDA backend's choices in its
# state.json instead, under STATE_CUDA_SETTINGS: the attention path that ran ("cudnn",
# "classic") and each switch and count as it was resolved, keyed by the name of the environment
# variable that set it then (RECORD_PREFIX + the key of the tables below). A numpy run's records
# none.
STATE_CUDA_SETTINGS = "cuda_settings"
RECORD_PREFIX = "ANDREA_"
RECORDED_SWITCHES = {"FUSIONS": "fusions", "GELU_FUSION": "gelu_in_gemm",
                     "QKV_ROWS": "qkv_rows", "LOGITS_LP": "logits_low_precision",
                     "GRADS_LP": "grads_low_precision", "FLEX_BWD": "flex_backward"}
RECORDED_CHUNK = "ATTN_CHUNK"  # gpu.attention_chunk
# a record without these was written before they existed, when they did not run
OFF_WHEN_NOT_RECORDED = frozenset({"logits_low_precision", "grads_low_precision",
                                   "flex_backward"})
# switches of paths the engine now always runs one way (that way), whose other way computed
# other bits or may have (the one-pass LayerNorm backward summed dγ/dβ in another order; an
# unpadded dwte GEMM is another GEMM problem); the side stream and the deferred update computed
# the same bits either way
FIXED_SWITCHES = {"WRITE_GRADS": True, "RESID_GEMM": False, "FUSED_LN": False, "DWTE_PAD": True}


def gpu_section_of_checkpoint(state: Any) -> tuple[dict[str, Any], list[str]]:
    """The gpu section a checkpoint written before that section existed computed with (from
    its state.json `state`), as the JSON the config's `gpu` key takes, and what the run's log
    should say about it. The attention path: classic where the record says the classic one ran
    in a precision that had cuDNN's to choose from, else auto (which takes cuDNN's where it
    runs, as the record's did). No record (a numpy run's, or one from before the records): every
    default. The values are checked as the config's are when the section is read."""
    st = state if isinstance(state, Mapping) else {}
    record = st.get(STATE_CUDA_SETTINGS)
    if not isinstance(record, Mapping) or not record:
        if st.get("backend") == "cuda":
            # written before the record existed, so before these paths did: they stay off
            off = {name: False for name in sorted(OFF_WHEN_NOT_RECORDED)}
            return off, ["the checkpoint records no CUDA settings (written before the engine "
                         "recorded them): " + ", ".join(f"gpu.{n} false" for n in off)
                         + " (paths that came later); the other choices take the gpu "
                         "section's defaults, and where one differs from the run's, the bits "
                         "differ from an uninterrupted run"]
        return {}, []
    gpu: dict[str, Any] = {}
    for key, name in RECORDED_SWITCHES.items():
        value = record.get(RECORD_PREFIX + key)
        gpu[name] = value if isinstance(value, bool) else name not in OFF_WHEN_NOT_RECORDED
    chunk = record.get(RECORD_PREFIX + RECORDED_CHUNK)
    if isinstance(chunk, int) and not isinstance(chunk, bool):
        gpu["attention_chunk"] = chunk
    config = st.get("config")
    train = config.get("train") if isinstance(config, Mapping) else None
    precision = train.get("precision") if isinstance(train, Mapping) else None
    if record.get("attention") == "classic" and precision != "fp32":
        gpu["attention"] = "classic"
    notes = [f"the checkpoint's run had {RECORD_PREFIX}{key}={int(record[RECORD_PREFIX + key])}, "
             f"a path the engine no longer has: the bits may differ from an uninterrupted run"
             for key, runs in FIXED_SWITCHES.items()
             if isinstance(record.get(RECORD_PREFIX + key), bool)
             and record[RECORD_PREFIX + key] != runs]
    return gpu, notes
