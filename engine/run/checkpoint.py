"""The checkpoint format (DESIGN §6): its names and files, verification, loading, statistics.

A checkpoint is `checkpoints/step_XXXXXXXX/` (or `step_XXXXXXXX-2`, `-3`, ... when a step was
checkpointed twice) with `model.ckpt` (the seed's binary format, `[int32 step][int32 n_params]
[w f32][m f32][v f32]`, little-endian, `8 + 12·n` bytes) and `state.json` (everything else
resume needs, plus the sha256 and size of `model.ckpt`, plus `state_sha256`, a digest of its own
canonical content, so an edited RNG/sampler state is caught too). A name that starts with
`.tmp-` is never a checkpoint. Verification does not trust the name: size, header against
state.json, tensor table and both digests are all checked. Writing is
engine.run.checkpoint_write; listing, choosing where a resume starts and pruning are
engine.run.checkpoint_store.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import stat
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine import infile, jsonio
from engine.errors import UserError
from engine.runfiles import CHECKPOINTS

FORMAT_VERSION = 1
MODEL_FILE = "model.ckpt"
STATE_FILE = "state.json"
HEADER = struct.Struct("<ii")
REASONS = ("periodic", "snapshot", "stop", "final")
CHUNK_BYTES = 8 << 20  # large enough for full disk bandwidth, small enough to stay out of the way

NAME_RE = re.compile(r"^step_(\d{8})(?:-(\d+))?$")
TMP_RE = re.compile(r"^\.tmp-.*-(\d+)-[0-9a-f]+$")  # group 1: the pid of the process using it
# Fields written by the checkpointer; the trainer's `state` must not shadow them.
CORE_FIELDS = (
    "format_version", "step", "n_params", "model_ckpt", "tensor_table", "reason", "wall_time",
    "state_sha256",
)


class CheckpointInvalid(UserError):
    """A checkpoint that must not be loaded; the message says exactly why."""


@dataclass
class Checkpoint:
    """A loaded, verified checkpoint. `state` is the whole state.json object."""

    path: Path
    step: int
    params: np.ndarray
    m: np.ndarray
    v: np.ndarray
    state: dict[str, Any]

    @property
    def tensor_table(self) -> list[dict[str, Any]]:
        return self.state["tensor_table"]


def checkpoint_dirname(step: int) -> str:
    return f"step_{step:08d}"


def temp_dirname(name: str) -> str:
    """A name in `checkpoints/` for `name` that is never a checkpoint and no other process
    takes: `.tmp-<name>-<pid>-<nonce>` (a crashed process's leftovers are told by its pid)."""
    return f".tmp-{name}-{os.getpid()}-{secrets.token_hex(4)}"


def ckpt_root_of(path: Path) -> Path:
    """`path/checkpoints` when `path` is a run directory, else `path` itself."""
    path = Path(path)
    return path / CHECKPOINTS if (path / CHECKPOINTS).is_dir() else path


# ---------------------------------------------------------------- verification


def normalize_tensor_table(table: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tensor table as a list of {name: str, shape: [int], offset: int} (extra keys dropped)."""
    return [{"name": str(t["name"]), "shape": [int(s) for s in t["shape"]],
             "offset": int(t["offset"])} for t in table]


def table_problem(table: list[dict[str, Any]], n: int) -> str | None:
    """None when the tensors tile [0, n) exactly in order, else what is wrong."""
    pos = 0
    for t in sorted(table, key=lambda t: t["offset"]):
        if t["offset"] != pos:
            return f"tensor {t['name']!r} starts at offset {t['offset']}, expected {pos}"
        pos += int(np.prod(t["shape"], dtype=np.int64))
    if pos != n:
        return f"tensors cover {pos} floats, expected n_params = {n}"
    return None


def state_digest(doc: dict[str, Any]) -> str:
    """sha256 of state.json's content without its own digest field (canonical JSON).

    Catches any edit of state.json (RNG states, sampler, ...), not just of the fields that the
    size and header checks bind. Python's JSON floats round-trip exactly, so this is stable.
    """
    body = {k: v for k, v in doc.items() if k != "state_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_structure(path: Path, doc: Any = None) -> tuple[dict[str, Any], int]:
    """Every check but the hash; returns (state.json object, n_params). Raises CheckpointInvalid.
    `doc`: state.json as the caller already read it (None: read it here)."""
    try:
        return _check_structure_unguarded(Path(path), doc)
    except OSError as e:
        raise CheckpointInvalid(f"{path}: unreadable ({e})") from None


def _require_file(f: Path) -> None:
    """CheckpointInvalid unless `f` is a regular file (a FIFO, a device or a socket is never
    opened: reading one could wait for ever)."""
    try:
        mode = os.stat(f).st_mode
    except FileNotFoundError:
        raise CheckpointInvalid(f"{f}: missing") from None
    if not stat.S_ISREG(mode):
        raise CheckpointInvalid(str(infile.refusal(f, mode)))


def read_state(state_path: Path) -> Any:
    """A checkpoint's state.json as parsed JSON (not yet checked); CheckpointInvalid when it
    does not parse."""
    try:
        return jsonio.load_file(state_path, max_bytes=jsonio.STATE_BYTES)
    except jsonio.JsonError as e:
        raise CheckpointInvalid(f"unparsable JSON: {e}") from None


def _check_fields(state_path: Path, doc: Any) -> None:
    """The fields of state.json that the checkpointer writes: present, of their types, and
    matching its own digest."""
    if not isinstance(doc, dict):
        raise CheckpointInvalid(f"{state_path}: expected a JSON object")
    for k in CORE_FIELDS:
        if k not in doc:
            raise CheckpointInvalid(f"{state_path}: field {k!r} missing")
    if state_digest(doc) != doc["state_sha256"]:
        raise CheckpointInvalid(f"{state_path}: content does not match its state_sha256 (edited?)")
    if doc["format_version"] != FORMAT_VERSION:
        raise CheckpointInvalid(
            f"{state_path}: format_version: expected {FORMAT_VERSION}, got {doc['format_version']!r}"
        )
    step, n, mc = doc["step"], doc["n_params"], doc["model_ckpt"]
    if not (_is_int(step) and _is_int(n) and step >= 0 and n > 0):
        raise CheckpointInvalid(f"{state_path}: step/n_params: expected integers, got {step!r}/{n!r}")
    if not (isinstance(mc, dict) and isinstance(mc.get("sha256"), str) and _is_int(mc.get("size"))):
        raise CheckpointInvalid(f"{state_path}: model_ckpt: expected {{sha256, size}}, got {mc!r}")


def _check_structure_unguarded(path: Path, doc: Any = None) -> tuple[dict[str, Any], int]:
    model, state_path = path / MODEL_FILE, path / STATE_FILE
    if not path.is_dir():
        raise CheckpointInvalid(f"{path}: not a checkpoint directory")
    for f in (state_path, model):
        _require_file(f)
    if doc is None:
        doc = read_state(state_path)
    _check_fields(state_path, doc)
    step, n, mc = doc["step"], doc["n_params"], doc["model_ckpt"]
    mt = NAME_RE.match(path.name)
    if mt and int(mt.group(1)) != step:
        raise CheckpointInvalid(f"{state_path}: step: {step} does not match directory {path.name}")
    expected = HEADER.size + 12 * n
    actual = model.stat().st_size
    if actual != expected:
        raise CheckpointInvalid(
            f"{model}: size: expected {expected} bytes (8 + 12 x n_params {n}), got {actual}"
        )
    if mc["size"] != actual:
        raise CheckpointInvalid(f"{state_path}: model_ckpt.size {mc['size']} != file size {actual}")
    with infile.open_regular(model) as f:
        h_step, h_n = HEADER.unpack(f.read(HEADER.size))
    if h_step != step:
        raise CheckpointInvalid(f"{model}: offset 0: header step {h_step}, state.json says {step}")
    if h_n != n:
        raise CheckpointInvalid(f"{model}: offset 4: header n_params {h_n}, state.json says {n}")
    try:
        table = normalize_tensor_table(doc["tensor_table"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointInvalid(f"{state_path}: tensor_table: malformed ({e!r})") from None
    problem = table_problem(table, n)
    if problem:
        raise CheckpointInvalid(f"{state_path}: tensor_table: {problem}")
    return doc, n


def _hash_mismatch(path: Path, expected: str, got: str) -> CheckpointInvalid:
    return CheckpointInvalid(
        f"{path / MODEL_FILE}: sha256 {got[:16]}... does not match state.json {expected[:16]}..."
    )


def verify_checkpoint(path: Path, *, check_hash: bool = True,
                      doc: Any = None) -> dict[str, Any]:
    """Raise CheckpointInvalid(reason) unless `path` is a complete, consistent checkpoint;
    returns its state.json object. `doc`: that object as the caller already read it."""
    doc, _ = _check_structure(Path(path), doc)
    if check_hash:
        h = hashlib.sha256()
        try:
            with infile.open_regular(Path(path) / MODEL_FILE) as f:
                while chunk := f.read(CHUNK_BYTES):
                    h.update(chunk)
        except OSError as e:
            raise CheckpointInvalid(f"{path}: unreadable ({e})") from None
        if h.hexdigest() != doc["model_ckpt"]["sha256"]:
            raise _hash_mismatch(Path(path), doc["model_ckpt"]["sha256"], h.hexdigest())
    return doc


# ---------------------------------------------------------------- loading


def load_checkpoint(path: Path) -> Checkpoint:
    """Read and verify a checkpoint in one pass over model.ckpt (hash computed while reading)."""
    path = Path(path)
    doc, n = _check_structure(path)
    buf = np.empty(3 * n, dtype="<f4")
    raw = memoryview(buf).cast("B")
    h = hashlib.sha256()
    try:
        with infile.open_regular(path / MODEL_FILE, buffering=0) as f:
            h.update(f.read(HEADER.size))
            pos = 0
            while pos < len(raw):
                got = f.readinto(raw[pos : pos + CHUNK_BYTES])
                if not got:
                    raise CheckpointInvalid(
                        f"{path / MODEL_FILE}: offset {8 + pos}: file ended early"
                    )
                h.update(raw[pos : pos + got])
                pos += got
    except OSError as e:
        raise CheckpointInvalid(f"{path}: unreadable ({e})") from None
    if h.hexdigest() != doc["model_ckpt"]["sha256"]:
        raise _hash_mismatch(path, doc["model_ckpt"]["sha256"], h.hexdigest())
    buf = buf.astype(np.float32, copy=False)  # native order (a no-op on little-endian hosts)
    return Checkpoint(path, doc["step"], buf[:n], buf[n : 2 * n], buf[2 * n :], doc)


# ---------------------------------------------------------------- statistics


def _stats(x: np.ndarray) -> dict[str, float]:
    x64 = x.astype(np.float64)
    if x64.size == 0:
        return {"mean": 0.0, "std": 0.0, "rms": 0.0, "max_abs": 0.0}
    return {
        "mean": float(x64.mean()),
        "std": float(x64.std()),
        "rms": float(np.sqrt(np.mean(x64 * x64))),
        "max_abs": float(np.max(np.abs(x64))),
    }


def tensor_stats(ckpt: Checkpoint) -> list[dict[str, Any]]:
    """Per tensor: name, shape, offset, and mean/std/rms/max_abs of weights, m and v (float64)."""
    out = []
    for t in normalize_tensor_table(ckpt.tensor_table):
        size = int(np.prod(t["shape"], dtype=np.int64))
        sl = slice(t["offset"], t["offset"] + size)
        out.append({
            **t,
            "weights": _stats(ckpt.params[sl]),
            "m": _stats(ckpt.m[sl]),
            "v": _stats(ckpt.v[sl]),
        })
    return out
