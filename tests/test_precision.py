"""train/precision and --precision as a user meets them on any machine: fp8 on the numpy
backend (the FP8 values emulated), the override on a fresh run and on --resume
(the checkpoint holds fp32 masters, so a run may go on in another precision), and where the
precision shows: the ready event, the dashboard's header, the launcher's command line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from engine.config import PRECISIONS, parse_config
from engine.errors import UserError
from engine.model.fp8 import FP8_GEMMS
from tests.conftest import ROOT, loss_records, micro_config_dict, run_engine


def ready_events(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()
            if '"ready"' in x]


def test_fp8_on_the_numpy_backend_trains_on_emulated_fp8_values(tmp_path: Path,
                                                                 write_config) -> None:
    """The numpy backend computes fp8 as fp32 with each layer's linear maps on FP8 values (the
    CUDA path's twin): it trains, and the log and the ready event say so."""
    cfg = write_config(micro_config_dict(max_steps=3))
    run = tmp_path / "run"
    r = run_engine(cfg, run, "--backend", "numpy", "--precision", "fp8")
    assert r.returncode == 0, r.stdout + r.stderr
    log = (run / "engine.log").read_text()
    assert "the layers' linear maps on FP8 values (delayed scaling)" in log
    [ready] = ready_events(run)
    assert ready["precision"] == "fp8" and ready["fp8_gemms"] == list(FP8_GEMMS)
    assert {g.split()[0] for g in ready["fp8_gemms"]} == {"qkv", "proj", "fc1", "fc2"}
    assert all(np.isfinite(x.loss) for x in loss_records(run))


def test_precision_values_and_the_override() -> None:
    assert "fp8" in PRECISIONS
    cfg = parse_config(micro_config_dict(precision="fp8"), "micro", ROOT)
    assert cfg.train.precision == "fp8"
    assert cfg.with_precision("bf16").train.precision == "bf16"
    with pytest.raises(UserError, match="expected one of"):
        cfg.with_precision("fp4")
    r = run_engine(Path("experiments/ANDREA-tiny-TRAIN.json"), Path("/nonexistent/x"),
                   "--precision", "fp4")
    assert r.returncode == 2 and "--precision" in r.stderr and "invalid choice" in r.stderr


def test_resume_in_another_precision_goes_on_and_says_so(tmp_path: Path, write_config) -> None:
    cfg = write_config(micro_config_dict(max_steps=8, precision="fp32"))
    run = tmp_path / "run"
    r = run_engine(cfg, run, "--backend", "numpy", "--max-steps", "5")
    assert r.returncode == 0, r.stderr
    r = run_engine(cfg, run, "--backend", "numpy", "--resume", "--precision", "bf16",
                   "--max-steps", "8")
    assert r.returncode == 0, r.stderr
    assert "NOT used" not in r.stderr  # an asked-for change is not an ignored setting
    log = (run / "engine.log").read_text()
    assert "--precision bf16 replaces the run's fp32" in log
    assert [x.step for x in loss_records(run)] == list(range(1, 9))
    first, then = ready_events(run)[0], ready_events(run)[-1]
    assert (first["precision"], then["precision"]) == ("fp32", "bf16")
    assert then["fp8_gemms"] == []
    # a precision given in the config file on --resume is still the checkpoint's (and said)
    cfg16 = write_config(micro_config_dict(max_steps=10, precision="fp16"))
    r = run_engine(cfg16, run, "--backend", "numpy", "--resume", "--max-steps", "10")
    assert r.returncode == 0 and "train.precision" in r.stderr and "NOT used" in r.stderr


def test_the_precision_travels_to_the_engine_and_shows_in_the_header() -> None:
    from andrea_tui import panels
    from andrea_tui.launcher import train_argv
    from andrea_tui.runstate import RunState
    from engine.records import Event, ReadyEvent

    argv = train_argv(Path("c.json"), Path("runs/x"), precision="fp8")
    assert argv[argv.index("--precision") + 1] == "fp8"
    assert "--precision" not in train_argv(Path("c.json"), Path("runs/x"))
    ev = ReadyEvent(t=1.0, backend="cuda", device="H200", precision="fp8",
                    fp8_gemms=["fc1 fwd", "fc2 fwd", "fc2 dgrad", "fc1 dgrad", "fc2 wgrad",
                               "fc1 wgrad"])
    back = Event.from_json(json.loads(json.dumps(ev.to_json())))
    assert back == ev
    hostile = Event.from_json({"t": 1, "event": "ready", "fp8_gemms": "all of them",
                               "precision": 8})
    assert isinstance(hostile, ReadyEvent) and hostile.fp8_gemms == [] and hostile.precision == ""
    st = RunState()
    st.add_events([ev.to_json()])
    assert "fp8 6 GEMMs" in panels.header(st, 2.0).plain
    st = RunState()
    st.add_events([ReadyEvent(t=1.0, backend="cuda", device="H200",
                              precision="bf16").to_json()])
    assert "fp8" not in panels.header(st, 2.0).plain


def test_a_checkpoint_says_which_gemms_ran_in_fp8() -> None:
    """state.json's fp8_gemms (engine.records.STATE_FP8_GEMMS), read tolerantly, and shown by
    `andrea-ckpt inspect` beside the precision; absent in other precisions."""
    from engine import records as rec
    from engine.run.ckpt_cli import _summary_lines, state_summary

    gemms = ["fc1 fwd", "fc2 fwd"]
    state = {"config": {"train": {"precision": "fp8"}}, rec.STATE_FP8_GEMMS: gemms}
    assert rec.fp8_gemms_of(state) == gemms
    assert rec.fp8_gemms_of({rec.STATE_FP8_GEMMS: "all"}) == []
    assert rec.fp8_gemms_of({rec.STATE_FP8_GEMMS: [3, "fc1 fwd"]}) == ["fc1 fwd"]
    assert rec.fp8_gemms_of("not a state") == []
    run_line = next(x for x in _summary_lines(state_summary(state)) if x.startswith("run:"))
    assert "precision fp8 (FP8: fc1 fwd, fc2 fwd)" in run_line
    plain = {"config": {"train": {"precision": "bf16"}}}
    assert state_summary(plain)["fp8_gemms"] == []
    assert "FP8" not in next(x for x in _summary_lines(state_summary(plain))
                             if x.startswith("run:"))
