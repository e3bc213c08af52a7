"""`andrea-ckpt`: inspect and verify checkpoints (DESIGN §10).

    andrea-ckpt inspect PATH [--json]   header, per-tensor statistics, state summary
    andrea-ckpt verify PATH             exit 0 when valid, 2 with the reason when not

PATH is one checkpoint directory, or a run directory / `checkpoints/` directory: then every
checkpoint is handled, newest first, and the exit status is 2 if ANY of them is invalid (the
message names each invalid one); a directory without checkpoints is exit 2 as well.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from engine.errors import UserError, cli_entry
from engine.run.checkpoint import (
    MODEL_FILE,
    STATE_FILE,
    CheckpointInvalid,
    list_checkpoints,
    load_checkpoint,
    tensor_stats,
    verify_checkpoint,
)

_CORE = (
    "format_version", "step", "n_params", "model_ckpt", "tensor_table", "reason", "wall_time",
    "state_sha256",
)


def _targets(path: Path) -> tuple[bool, list[Path]]:
    """(is_single_checkpoint, checkpoint dirs newest first). Raises UserError for bad PATH."""
    if not path.exists():
        raise UserError(f"{path}: no such file or directory")
    if not path.is_dir():
        raise UserError(f"{path}: expected a checkpoint or run directory")
    if (path / STATE_FILE).exists() and (path / MODEL_FILE).exists():
        return True, [path]
    if path.name.startswith("step_"):
        return True, [path]  # a checkpoint dir with a file missing: verify says which
    dirs = [e.path for e in list_checkpoints(path, check_hash=False)]
    if not dirs:
        raise UserError(f"{path}: no checkpoints found (expected step_XXXXXXXX directories)")
    return False, dirs


def _find(state: dict[str, Any], *keys: str) -> Any:
    """The first of `keys` present at the top level or one level down (layouts may nest)."""
    for k in keys:
        if k in state:
            return state[k]
    for v in state.values():
        if isinstance(v, dict):
            for k in keys:
                if k in v:
                    return v[k]
    return None


def state_summary(state: dict[str, Any]) -> dict[str, Any]:
    """The resume-relevant parts of state.json that a person wants to see first."""
    bandit = state.get("bandit") if isinstance(state.get("bandit"), dict) else {}
    return {
        "reason": state.get("reason"),
        "step": state.get("step"),
        "n_params": state.get("n_params"),
        "wall_time": state.get("wall_time"),
        "tokens": _find(state, "tokens", "token_counter", "tokens_seen"),
        "lr": _find(state, "lr", "last_lr"),
        "schedule": state.get("schedule"),
        "loss_scale": state.get("loss_scale"),
        "bandit_phase": _find(bandit, "phase", "phase_index"),
        "bandit_weights": _find(bandit, "weights"),
        "sampler": state.get("sampler"),
        "other_keys": sorted(k for k in state if k not in _CORE),
    }


def _inspect_one(path: Path) -> dict[str, Any]:
    ckpt = load_checkpoint(path)  # verifies first: raises CheckpointInvalid with the reason
    st = ckpt.state
    return {
        "path": str(path),
        "valid": True,
        "header": {"step": ckpt.step, "n_params": int(ckpt.params.size)},
        "model_ckpt": st["model_ckpt"],
        "summary": state_summary(st),
        "tensors": tensor_stats(ckpt),
    }


def _short(x: Any, width: int = 90) -> str:
    s = json.dumps(x, separators=(",", ":"))
    return s if len(s) <= width else s[: width - 3] + "..."


def _print_report(r: dict[str, Any]) -> None:
    h, s = r["header"], r["summary"]
    print(f"{r['path']}: valid")
    print(f"  header: step {h['step']}  n_params {h['n_params']:,}  "
          f"model.ckpt {r['model_ckpt']['size']:,} bytes  sha256 {r['model_ckpt']['sha256'][:16]}")
    for k in ("reason", "tokens", "lr", "schedule", "loss_scale", "bandit_phase",
              "bandit_weights", "sampler"):
        if s[k] is not None:
            print(f"  {k}: {_short(s[k])}")
    print(f"  state keys: {', '.join(s['other_keys']) or '-'}")
    print(f"  {'tensor':<22}{'shape':>14}  {'':1}{'mean':>11}{'std':>11}{'rms':>11}{'max|x|':>11}")
    for t in r["tensors"]:
        shape = "x".join(map(str, t["shape"]))
        for i, part in enumerate(("weights", "m", "v")):
            st = t[part]
            label = t["name"] if i == 0 else ""
            print(f"  {label:<22}{shape if i == 0 else '':>14}  {part[0]}"
                  f"{st['mean']:11.3e}{st['std']:11.3e}{st['rms']:11.3e}{st['max_abs']:11.3e}")


def _cmd_inspect(path: Path, as_json: bool) -> int:
    single, dirs = _targets(path)
    reports: list[dict[str, Any]] = []
    bad: list[str] = []
    for d in dirs:
        try:
            reports.append(_inspect_one(d))
        except CheckpointInvalid as e:
            if single:
                raise
            reports.append({"path": str(d), "valid": False, "invalid_reason": str(e)})
            bad.append(str(e))
    if as_json:
        print(json.dumps(reports[0] if single else reports, indent=1))
    else:
        for r in reports:
            if r["valid"]:
                _print_report(r)
            else:
                print(f"{r['path']}: INVALID: {r['invalid_reason']}")
    if bad:
        raise CheckpointInvalid(f"{len(bad)} of {len(dirs)} checkpoints invalid: " + "; ".join(bad))
    return 0


def _cmd_verify(path: Path) -> int:
    single, dirs = _targets(path)
    bad: list[str] = []
    for d in dirs:
        try:
            verify_checkpoint(d)
        except CheckpointInvalid as e:
            if single:
                raise
            print(f"invalid {d}: {e}")
            bad.append(d.name)
            continue
        st = json.loads((d / STATE_FILE).read_bytes())
        print(f"valid {d} (step {st['step']}, {st['reason']}, "
              f"{st['model_ckpt']['size']:,} bytes)")
    if bad:
        raise CheckpointInvalid(
            f"{path}: {len(bad)} of {len(dirs)} checkpoints invalid: {', '.join(bad)}"
        )
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="andrea-ckpt", description="Inspect and verify checkpoints.")
    sub = p.add_subparsers(dest="cmd", required=True)
    pi = sub.add_parser("inspect", help="header, per-tensor statistics, state summary")
    pi.add_argument("path", type=Path, help="checkpoint directory or run directory")
    pi.add_argument("--json", action="store_true", help="machine-readable output")
    pv = sub.add_parser("verify", help="size, header, tensor table and sha256; exit 2 if invalid")
    pv.add_argument("path", type=Path, help="checkpoint directory or run directory")
    return p


@cli_entry
def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.cmd == "inspect":
        return _cmd_inspect(args.path, args.json)
    return _cmd_verify(args.path)


if __name__ == "__main__":
    main()
