"""`andrea-ckpt verify` / `inspect`: exit statuses, messages, and the statistics it prints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engine.run.checkpoint import write_checkpoint
from engine.run.ckpt_cli import main

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
        st = {"tokens": step * 64, "bandit": {"phase": 3, "weights": {"a": 0.4, "b": 0.6}},
              "sampler": {"cursor": step}, "lr": 5e-4}
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
    assert (s["reason"], s["tokens"], s["lr"], s["bandit_phase"]) == ("snapshot", 1280, 5e-4, 3)
    assert s["bandit_weights"] == {"a": 0.4, "b": 0.6} and s["sampler"] == {"cursor": 20}
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
    assert "wte" in out and "lnf.gamma" in out and "tokens: 1280" in out and "max|x|" in out
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
