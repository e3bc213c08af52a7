"""The CUDA backend's settings that decide a run's bits, resolved once at start and recorded with
the run (a checkpoint's state.json `cuda_settings`: engine.records.STATE_CUDA_SETTINGS).

Each is the environment's when it is set, else what the run being resumed recorded
(engine.records.cuda_settings_of), else its default; so a resume computes the same bits even where
a default changed since, and one given otherwise by the environment is noted (the bits then
differ from an uninterrupted run). Two kinds:

- switches (`CudaSettings.flag`: "0" is off, anything else on): ANDREA_FUSIONS and
  ANDREA_GELU_FUSION (each with its README row) and a fusion's own switch, for bisecting one
  away: ANDREA_SIDE_STREAM (the weight-gradient stream), ANDREA_FUSED_LN (the one-pass LayerNorm
  backward; off by default, no faster in the step on the H200, NOTES.md), ANDREA_WRITE_GRADS
  (the step writes its gradients instead of zeroing and adding), ANDREA_DWTE_PAD (dwte's GEMM
  over the aligned rows), ANDREA_DEFER_ADAMW (a step's AdamW in the next step's graph, beside its
  forward), ANDREA_QKV_ROWS (Q, K, V side by side in rows), ANDREA_RESID_GEMM (the forward's
  residual adds in the GEMM epilogues; off by default), ANDREA_LOGITS_LP (the training logits
  in the compute precision; off where a resumed record predates it), ANDREA_GRADS_LP (the
  layers' weight gradients in bf16 where a bf16 step writes them; off where a resumed record
  predates it), ANDREA_FLEX_BWD (the flex deterministic attention backward instead of cuDNN's;
  on for a new run, off where a resumed record predates it, recorded off where it cannot run:
  flex_attn.py);
- counts (`CudaSettings.count`: an integer from 1): ANDREA_ATTN_CHUNK (the classic attention's
  queries per causal chunk, the shapes of its GEMMs).

Besides these, `values` holds the attention path the backend picked ("attention": "cudnn" or
"classic"; ANDREA_ATTENTION only says what to prefer). ops.py reads ANDREA_SIDE_LN (where the
LayerNorm parameter sums run) and the backend ANDREA_STREAM_PRIORITY (the weight-gradient
stream below the main stream); the same bits either way, so neither is recorded.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from engine.errors import UserError
from engine.records import COUNT_MAX

ATTENTIONS = ("auto", "cudnn", "classic")


def default_attention() -> str:
    """ANDREA_ATTENTION, checked (default auto)."""
    a = os.environ.get("ANDREA_ATTENTION", "auto")
    if a not in ATTENTIONS:
        raise UserError(f"ANDREA_ATTENTION: expected auto, cudnn or classic, got {a!r}")
    return a


def switch_value(raw: str | None, recorded: Any, default: bool) -> bool:
    """A switch's value: the environment's when it is set (raw; "0" is off, anything else on),
    else the one the run being resumed recorded (a bool), else the default."""
    if raw is not None:
        return raw != "0"
    return recorded if isinstance(recorded, bool) else default


def count_value(name: str, raw: str | None, recorded: Any, default: int) -> int:
    """A count's value, as switch_value: the environment's (an integer from 1 to COUNT_MAX in
    ASCII digits, else a UserError naming it), else the record's (an int), else the default."""
    if raw is not None:
        text = raw.strip()
        # the leading zeros off first: int() refuses strings of over 4300 digits, zeros or not
        digits = text.lstrip("0") or "0"
        if not (text.isascii() and text.isdigit() and len(digits) <= 10
                and 1 <= int(digits) <= COUNT_MAX):
            raise UserError(f"{name}: expected an integer from 1 to {COUNT_MAX}, got {raw!r}")
        return int(digits)
    if isinstance(recorded, int) and not isinstance(recorded, bool) and recorded >= 1:
        return recorded
    return default


class CudaSettings:
    """One start's resolution of the settings: `values` (what the run records) and, appended to
    `notes` (the backend's list, for the run's log), every setting the environment gives against
    the record, and a count a resumed record should hold and does not."""

    def __init__(self, recorded: Mapping[str, Any] | None, notes: list[str]) -> None:
        self.recorded = dict(recorded or {})
        self.values: dict[str, bool | int | str] = {}
        self.notes = notes

    def flag(self, name: str, default: bool = True) -> bool:
        """A switch (module doc), resolved and recorded."""
        raw = os.environ.get(name)
        recorded = self.recorded.get(name)
        value = switch_value(raw, recorded, default)
        self.values[name] = value
        if raw is not None and isinstance(recorded, bool) and recorded != value:
            self._differs(name, raw, int(recorded))
        return value

    def count(self, name: str, default: int, record: bool = True,
              expected: bool = False) -> int:
        """A count (module doc), resolved and checked; recorded where it decides the bits
        (`record`: the classic attention's chunk only where the classic attention runs).
        `expected`: the record comes from a run where it decided the bits too (a classic run's,
        for the chunk); one that lacks it then (written before counts were recorded, when the
        README said to keep the chunk by hand) is noted: the default runs."""
        raw = os.environ.get(name)
        recorded = self.recorded.get(name)
        value = count_value(name, raw, recorded, default)
        if record:
            self.values[name] = value
            if raw is not None and count_value(name, None, recorded, value) != value:
                self._differs(name, raw, recorded)
            elif raw is None and expected and name not in self.recorded:
                self.notes.append(f"{name}: the run's record has none (written before it was "
                                  f"recorded): {value} runs; if the run ran with another, set "
                                  f"{name} to it")
        return value

    def carry_recorded(self) -> None:
        """Keep the record's other settings (one this start did not read) in what the run
        records: after every resolved one, so they never crowd one out."""
        for name, value in self.recorded.items():
            self.values.setdefault(name, value)

    def _differs(self, name: str, raw: str, recorded: Any) -> None:
        self.notes.append(f"{name}={raw} from the environment, where the run recorded "
                          f"{recorded}: the bits may differ from an uninterrupted run")
