"""`andrea-ckpt verify` / `inspect`: exit statuses, messages, the statistics it prints, and the
state summary it prints, checked against a checkpoint written by a real engine run."""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine.run.checkpoint_write import write_checkpoint
from engine.run.ckpt_cli import main
from tests.conftest import DATA_DIR, loss_records, micro_config_dict, run_engine

REPO = Path(__file__).resolve().parents[1]
TABLE = [{"name": "wte", "shape": [6, 5], "offset": 0}, {"name": "lnf.gamma", "shape": [5],
                                                          "offset": 30}]
N = 35


def arrays(step: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(step)
    return tuple(rng.standard_normal(N).astype(np.float32) for _ in range(3))  # type: ignore


def make_run(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    for step, reason in ((10, "periodic"), (20, "snapshot")):
        st = {"tokens": step * 64}  # the rest of what the engine writes is missing here
        write_checkpoint(run / "checkpoints", step, *arrays(step), st, reason, TABLE)
    return run


def run_main(argv: list[str], capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    out, err = capsys.readouterr()
    return exc.value.code, out, err


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 1]))


def test_verify_valid_checkpoint_and_run_dir(tmp_path: Path, capsys) -> None:
    run = make_run(tmp_path)
    code, out, _ = run_main(["verify", str(run / "checkpoints" / "step_00000020")], capsys)
    assert code == 0 and out.startswith("valid ") and "step 20, snapshot" in out
    code, out, _ = run_main(["verify", str(run)], capsys)
    lines = out.splitlines()
    assert code == 0 and len(lines) == 2
    assert "step_00000020" in lines[0] and "step_00000010" in lines[1]  # newest first


def test_verify_invalid_exits_2_and_says_which_and_why(tmp_path: Path, capsys) -> None:
    run = make_run(tmp_path)
    old = run / "checkpoints" / "step_00000010"
    flip(old / "model.ckpt", 8 + 4 * 3)
    code, _, err = run_main(["verify", str(old)], capsys)
    assert code == 2 and err.startswith("error: ") and "sha256" in err
    code, out, err = run_main(["verify", str(run)], capsys)
    assert code == 2
    assert "valid " in out and "invalid " in out and "sha256" in out
    assert "1 of 2 checkpoints invalid: step_00000010" in err
    os.truncate(old / "model.ckpt", 100)
    code, _, err = run_main(["verify", str(old)], capsys)
    assert code == 2 and f"expected {8 + 12 * N} bytes" in err and "got 100" in err


def test_verify_bad_paths(tmp_path: Path, capsys) -> None:
    code, _, err = run_main(["verify", str(tmp_path / "nope")], capsys)
    assert code == 2 and "no such file" in err
    code, _, err = run_main(["verify", str(tmp_path)], capsys)
    assert code == 2 and "no checkpoints found" in err
    half = tmp_path / "step_00000001"
    half.mkdir()
    code, _, err = run_main(["verify", str(half)], capsys)
    assert code == 2 and "missing" in err


def test_inspect_json_matches_an_independent_computation(tmp_path: Path, capsys) -> None:
    run = make_run(tmp_path)
    code, out, _ = run_main(["inspect", str(run / "checkpoints" / "step_00000020"), "--json"],
                            capsys)
    assert code == 0
    rep = json.loads(out)
    assert rep["header"] == {"step": 20, "n_params": N}
    s = rep["summary"]
    assert (s["reason"], s["step"], s["tokens"], s["other_keys"]) == ("snapshot", 20, 1280,
                                                                      ["tokens"])
    assert s["run_id"] is None and s["schedule"]["lr"] is None  # not in this state: None
    p, m, v = arrays(20)
    for t in rep["tensors"]:
        lo, hi = t["offset"], t["offset"] + int(np.prod(t["shape"]))
        for key, arr in (("weights", p), ("m", m), ("v", v)):
            x = [float(a) for a in arr[lo:hi]]
            mean = sum(x) / len(x)
            assert t[key]["mean"] == pytest.approx(mean, rel=1e-12)
            assert t[key]["std"] == pytest.approx(
                (sum((a - mean) ** 2 for a in x) / len(x)) ** 0.5, rel=1e-9)
            assert t[key]["rms"] == pytest.approx((sum(a * a for a in x) / len(x)) ** 0.5,
                                                  rel=1e-12)
            assert t[key]["max_abs"] == max(abs(a) for a in x)


def test_inspect_text_and_run_dir(tmp_path: Path, capsys) -> None:
    run = make_run(tmp_path)
    code, out, _ = run_main(["inspect", str(run)], capsys)
    assert code == 0
    assert out.index("step_00000020: valid") < out.index("step_00000010: valid")
    assert "wte" in out and "lnf.gamma" in out and "tokens: 1,280" in out and "max|x|" in out
    assert "  schedule: step - of -  lr -  warmup - steps\n" in out  # missing fields: `-`
    flip(run / "checkpoints" / "step_00000020" / "model.ckpt", 4)
    code, out, err = run_main(["inspect", str(run)], capsys)
    assert code == 2 and "INVALID" in out and "header n_params" in out and "1 of 2" in err


def test_console_exit_status_through_python_m(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    ok = subprocess.run([sys.executable, "-m", "engine.run.ckpt_cli", "verify", str(run)],
                        capture_output=True, text=True, env=env)
    assert ok.returncode == 0, ok.stderr
    (run / "checkpoints" / "step_00000020" / "state.json").write_text("{")
    bad = subprocess.run([sys.executable, "-m", "engine.run.ckpt_cli", "verify", str(run)],
                         capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and "unparsable JSON" in bad.stdout
    assert "Traceback" not in bad.stderr
    usage = subprocess.run([sys.executable, "-m", "engine.run.ckpt_cli"], capture_output=True,
                           text=True, env=env)
    assert usage.returncode == 2


# ---------------------------------------------------------------- a real engine run


@pytest.fixture(scope="module")
def real_run(tmp_path_factory: pytest.TempPathFactory, prepared_data: Path) -> Path:
    """12 micro steps: a periodic checkpoint at step 10 and the final one at step 12."""
    tmp = tmp_path_factory.mktemp("ckpt-cli")
    cfg = tmp / "cfg.json"
    cfg.write_text(json.dumps(micro_config_dict(max_steps=12)))
    run = tmp / "run"
    r = run_engine(cfg, run)
    assert r.returncode == 0, r.stderr
    return run


def expected_summary(run: Path, step: int) -> dict[str, Any]:
    """What `inspect` must show for the checkpoint at `step`, from sources other than its
    state.json: the config, engine.json, loss.jsonl, events.jsonl and the prepared data."""
    cfg = json.loads((run / "config.json").read_text())
    engine = json.loads((run / "engine.json").read_text())
    recs = {r.step: r for r in loss_records(run)}
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    manifest = json.loads((DATA_DIR / "manifest.json").read_text())
    train = cfg["train"]
    rec = recs[step]
    skipped = sum(recs[s].skipped for s in range(1, step + 1))
    phase, phase_step, phase_len, weights = rec.phase, rec.phase_step, rec.phase_len, rec.weights
    if phase_step == phase_len:  # this step ended the phase: the next one is in the checkpoint
        [change] = [e for e in events if e["event"] == "phase" and e["step"] == step]
        phase, phase_step, phase_len, weights = (change["phase"], 0, change["phase_len"],
                                                 change["weights"])
    return {
        "reason": "final" if step == train["max_steps"] else "periodic",
        "step": step,
        "run_id": engine["run_id"],
        "backend": "numpy",
        "experiment": cfg["name"],
        "precision": train["precision"],
        "tokens": step * train["batch_size"] * cfg["model"]["seq_len"] * train["grad_accum"],
        "schedule": {"step": step, "max_steps": train["max_steps"], "lr": rec.lr,
                     "warmup_steps": cfg["optim"]["warmup_steps"]},
        "trainer": {"adam_t": step - skipped, "skipped_steps": skipped,
                    "loss_scale": {"enabled": False, "scale": 1.0, "good_steps": 0}},
        "bandit": {"phase": phase, "phase_step": phase_step, "phase_len": phase_len,
                   "score": cfg["bandit"].get("score", "progress"), "weights": weights},
        "sampler": {"seed": train["seed"], "seq_len": cfg["model"]["seq_len"],
                    "n_sources": len(cfg["data"]["sources"])},
        "data": {"tokenizer_sha256": manifest["shards"]["python-reference"]["tokenizer"],
                 "tokens": {n: sh["tokens"] for n, sh in manifest["shards"].items()}},
        "versions": {"python": platform.python_version(), "numpy": np.__version__},
        "world_size": 1,
    }


def none_fields(x: Any, at: str = "") -> list[str]:
    """Dotted paths of the None values in a nested summary."""
    if x is None:
        return [at]
    if isinstance(x, dict):
        return [p for k, v in x.items() for p in none_fields(v, f"{at}.{k}" if at else k)]
    return []


@pytest.mark.slow
@pytest.mark.parametrize("step", [10, 12])
def test_inspect_json_shows_what_the_engine_wrote(real_run: Path, step: int, capsys) -> None:
    code, out, _ = run_main(["inspect", str(real_run / "checkpoints" / f"step_{step:08d}"),
                             "--json"], capsys)
    assert code == 0
    s = json.loads(out)["summary"]
    assert none_fields(s) == []  # every field shown is one the engine really writes
    want = expected_summary(real_run, step)
    assert {k: s[k] for k in want} == want
    assert s["n_params"] == json.loads(out)["header"]["n_params"]
    state = json.loads((real_run / "checkpoints" / f"step_{step:08d}" / "state.json").read_text())
    assert s["wall_time"] == state["wall_time"]
    assert set(s["other_keys"]) == {"backend", "bandit", "config", "data", "mixture", "run_id",
                                    "sampler", "schedule", "tokens", "trainer", "versions",
                                    "world_size"}


@pytest.mark.slow
def test_inspect_text_shows_what_the_engine_wrote(real_run: Path, capsys) -> None:
    code, out, _ = run_main(["inspect", str(real_run)], capsys)
    assert code == 0
    final = out[out.index("step_00000012: valid"):out.index("step_00000010: valid")]
    summary = final[:final.index("  tensor ")].splitlines()[2:]
    assert [line.split(":")[0].strip() for line in summary] == [
        "reason", "run", "tokens", "schedule", "trainer", "bandit", "bandit weights", "sampler",
        "data", "versions", "state keys"]
    missing = [line for line in summary if re.search(r"(?<![\w.])-(?![\w.])", line)]
    assert missing == []  # nothing printed as `-` (a field the engine does not write)
    e = expected_summary(real_run, 12)
    sch, tr, bd = e["schedule"], e["trainer"], e["bandit"]
    assert f"  run: {e['run_id']}  backend numpy  experiment ANDREA-micro" in final
    assert f"  tokens: {e['tokens']:,}\n" in final
    assert (f"  schedule: step 12 of 12  lr {sch['lr']:.3e}  warmup {sch['warmup_steps']} "
            "steps\n") in final
    assert (f"  trainer: adam_t {tr['adam_t']}  skipped_steps {tr['skipped_steps']}  "
            "loss_scale 1 (off)\n") in final
    assert (f"  bandit: phase {bd['phase']}, {bd['phase_step']} of {bd['phase_len']} steps done"
            in final)
    assert "  bandit weights: " + ", ".join(
        f"{n} {w:.4f}" for n, w in bd["weights"].items()) + "\n" in final
    assert f"  sampler: seed {e['sampler']['seed']}  seq_len 32  sources 3\n" in final
    assert f"tokenizer sha256 {e['data']['tokenizer_sha256'][:16]}" in final


def test_prune_keeps_the_newest_and_dry_run_deletes_nothing(tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    for step, reason in ((5, "periodic"), (6, "snapshot"), (7, "stop"), (8, "snapshot")):
        write_checkpoint(run / "checkpoints", step, *arrays(step), {"tokens": step}, reason,
                         TABLE)
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    code, out, _ = run_main(["prune", str(run), "--keep", "2", "--dry-run"], capsys)
    assert code == 0 and "would remove 2 checkpoint(s)" in out
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before
    code, out, _ = run_main(["prune", str(run), "--keep", "2"], capsys)
    assert code == 0 and "removed 2 checkpoint(s)" in out
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000007",
                                                                       "step_00000008"]
    code, _, err = run_main(["prune", str(tmp_path), "--keep", "1"], capsys)
    assert code == 2 and "not a run directory" in err
    code, _, err = run_main(["prune", str(run), "--keep", "0"], capsys)
    assert code == 2 and "--keep" in err
