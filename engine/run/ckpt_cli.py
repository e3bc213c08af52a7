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
import time
from pathlib import Path
from typing import Any

from engine import records as rec
from engine.errors import UserError, cli_entry
from engine.run.checkpoint import (
    CORE_FIELDS,
    MODEL_FILE,
    REASONS,
    STATE_FILE,
    CheckpointInvalid,
    ckpt_root_of,
    load_checkpoint,
    tensor_stats,
    verify_checkpoint,
)
from engine.run.checkpoint_store import list_checkpoints, prune, summarize


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


def _dig(d: Any, *path: str) -> Any:
    """d[path[0]][path[1]]...; None where a level is missing or not an object."""
    for k in path:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def _pick(d: Any, *keys: str) -> dict[str, Any]:
    """{key: d[key]} for each key, None for those `d` lacks (shown as `-`)."""
    return {k: _dig(d, k) for k in keys}


def _by_source(names: Any, values: Any) -> dict[str, Any] | None:
    if not (isinstance(names, list) and isinstance(values, list) and len(names) == len(values)):
        return None
    return dict(zip(names, values, strict=True))


def state_summary(state: dict[str, Any]) -> dict[str, Any]:
    """The parts of state.json a person wants to see first, read from where the engine writes
    them (engine.run.checkpointing `_state`: trainer, schedule, bandit, sampler, data, ...). A
    field the checkpoint lacks is None."""
    bandit = state.get("bandit")
    return {
        "reason": state.get("reason"),
        "step": state.get("step"),
        "n_params": state.get("n_params"),
        "wall_time": state.get("wall_time"),
        "run_id": state.get("run_id"),
        "backend": state.get("backend"),
        "experiment": _dig(state, "config", "name"),
        "precision": _dig(state, "config", "train", "precision"),
        "fp8_gemms": rec.fp8_gemms_of(state),  # the GEMMs that ran in FP8 (none: [])
        "tokens": state.get("tokens"),
        "schedule": _pick(state.get("schedule"), "step", "max_steps", "lr", "warmup_steps"),
        "trainer": {
            **_pick(state.get("trainer"), "adam_t", "skipped_steps"),
            "loss_scale": _pick(_dig(state, "trainer", "loss_scale"), "enabled", "scale",
                                "good_steps"),
        },
        "bandit": {
            **_pick(bandit, "phase", "phase_step", "phase_len", "score"),
            "weights": _by_source(_dig(bandit, "source_names"), _dig(bandit, "weights")),
        },
        "sampler": _pick(state.get("sampler"), "seed", "seq_len", "n_sources"),
        "data": _pick(state.get("data"), "tokenizer_sha256", "tokens"),
        "versions": state.get("versions"),
        "world_size": state.get("world_size", 1),  # data-parallel ranks that wrote it
        "other_keys": sorted(k for k in state if k not in CORE_FIELDS),
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


def _v(x: Any, fmt: str = "") -> str:
    """One value for the text report: `-` when the checkpoint lacks it."""
    if x is None:
        return "-"
    if fmt and isinstance(x, (int, float)) and not isinstance(x, bool):
        return format(x, fmt)
    return str(x)


def _when(t: Any) -> str:
    if not isinstance(t, (int, float)):
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(t))


def _summary_lines(s: dict[str, Any]) -> list[str]:
    sch, tr, bd = s["schedule"], s["trainer"], s["bandit"]
    ls, smp, data = tr["loss_scale"], s["sampler"], s["data"]
    weights = bd["weights"]
    mixture = ", ".join(f"{n} {_v(w, '.4f')}" for n, w in weights.items()) if weights else "-"
    scaling = (f"dynamic, {_v(ls['good_steps'])} good steps" if ls["enabled"]
               else "off" if ls["enabled"] is False else "-")
    src_tokens = data["tokens"]
    per_source = (", ".join(f"{n} {_v(c, ',')}" for n, c in src_tokens.items())
                  if isinstance(src_tokens, dict) else "-")
    sha = data["tokenizer_sha256"]
    versions = s["versions"]
    return [
        f"reason: {_v(s['reason'])}  written {_when(s['wall_time'])}",
        f"run: {_v(s['run_id'])}  backend {_v(s['backend'])}  experiment {_v(s['experiment'])}"
        f"  precision {_v(s['precision'])}"
        + (f" (FP8: {', '.join(s['fp8_gemms'])})" if s["fp8_gemms"] else "")
        + f"  ranks {_v(s['world_size'])}",
        f"tokens: {_v(s['tokens'], ',')}",
        f"schedule: step {_v(sch['step'])} of {_v(sch['max_steps'])}  lr {_v(sch['lr'], '.3e')}"
        f"  warmup {_v(sch['warmup_steps'])} steps",
        f"trainer: adam_t {_v(tr['adam_t'])}  skipped_steps {_v(tr['skipped_steps'])}"
        f"  loss_scale {_v(ls['scale'], 'g')} ({scaling})",
        f"bandit: phase {_v(bd['phase'])}, {_v(bd['phase_step'])} of {_v(bd['phase_len'])} "
        f"steps done  score {_v(bd['score'])}",
        f"bandit weights: {mixture}",
        f"sampler: seed {_v(smp['seed'])}  seq_len {_v(smp['seq_len'])}"
        f"  sources {_v(smp['n_sources'])}",
        f"data: tokenizer sha256 {sha[:16] if isinstance(sha, str) else '-'}"
        f"  tokens {per_source}",
        "versions: " + (", ".join(f"{k} {v}" for k, v in versions.items())
                        if isinstance(versions, dict) else "-"),
        f"state keys: {', '.join(s['other_keys']) or '-'}",
    ]


def _print_report(r: dict[str, Any]) -> None:
    h, s = r["header"], r["summary"]
    print(f"{r['path']}: valid")
    print(f"  header: step {h['step']}  n_params {h['n_params']:,}  "
          f"model.ckpt {r['model_ckpt']['size']:,} bytes  sha256 {r['model_ckpt']['sha256'][:16]}")
    for line in _summary_lines(s):
        print(f"  {line}")
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
        raise CheckpointInvalid(f"{len(bad)} of {len(dirs)} checkpoints invalid: "
                                + summarize(bad, sep="; "))
    return 0


def _cmd_verify(path: Path) -> int:
    single, dirs = _targets(path)
    bad: list[str] = []
    for d in dirs:
        try:
            st = verify_checkpoint(d)
        except CheckpointInvalid as e:
            if single:
                raise
            print(f"invalid {d}: {e}")
            bad.append(d.name)
            continue
        print(f"valid {d} (step {st['step']}, {st['reason']}, "
              f"{st['model_ckpt']['size']:,} bytes)")
    if bad:
        raise CheckpointInvalid(
            f"{path}: {len(bad)} of {len(dirs)} checkpoints invalid: {summarize(bad)}"
        )
    return 0


def _cmd_prune(path: Path, keep: int, dry_run: bool) -> int:
    """Keep the `keep` newest checkpoints of a run (the newest valid one always stays)."""
    from engine.run.control import engine_alive

    root = ckpt_root_of(path)
    if not root.is_dir() or root.name != "checkpoints":
        raise UserError(f"{path}: not a run directory (no checkpoints/ in it)")
    run_dir = root.parent
    if not dry_run and engine_alive(run_dir)[0]:
        raise UserError(f"{run_dir}: an engine is training there; prune once it has stopped "
                        "(or look with --dry-run)")
    gone = prune(root, keep, REASONS, dry_run=dry_run, all_or_nothing=True)
    verb = "would remove" if dry_run else "removed"
    for g in gone:
        print(f"{verb} {g}")
    print(f"{verb} {len(gone)} checkpoint(s); kept the {keep} newest valid ones")
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="andrea-ckpt", description="Inspect and verify checkpoints.")
    sub = p.add_subparsers(dest="cmd", required=True)
    pi = sub.add_parser("inspect", help="header, per-tensor statistics, state summary")
    pi.add_argument("path", type=Path, help="checkpoint directory or run directory")
    pi.add_argument("--json", action="store_true", help="machine-readable output")
    pv = sub.add_parser("verify", help="size, header, tensor table and sha256; exit 2 if invalid")
    pv.add_argument("path", type=Path, help="checkpoint directory or run directory")
    pp = sub.add_parser("prune", help="delete all but the newest N checkpoints of a run")
    pp.add_argument("path", type=Path, help="run directory or its checkpoints/ directory")
    pp.add_argument("--keep", type=int, required=True, help="how many checkpoints to keep")
    pp.add_argument("--dry-run", action="store_true", help="list what would go, delete nothing")
    return p


@cli_entry
def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.cmd == "inspect":
        return _cmd_inspect(args.path, args.json)
    if args.cmd == "prune":
        return _cmd_prune(args.path, args.keep, args.dry_run)
    return _cmd_verify(args.path)


if __name__ == "__main__":
    main()
