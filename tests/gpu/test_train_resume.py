"""andrea-train on the CUDA backend: SIGTERM at step k and --resume gives, bit for bit, the same
loss records and final model.ckpt as N steps straight (DESIGN §6), with the run's own gpu
section; and a checkpoint written before the config had that section resumes as its run went
on (tests/fixtures/resume-before-gpu-config-cuda/, where it is there)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import (
    engine_cmd,
    loss_records,
    micro_config_dict,
    run_engine,
    start_engine,
    wait_for_step,
)
from tests.resume_fixture import FIXTURES, install, step_records

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

N, K = 30, 17
CUDA = ("--backend", "cuda")
KEYS = ("step", "loss", "grad_norm", "clip_scale", "lr", "tokens", "phase", "weights", "src_loss")
FIXTURE = FIXTURES / "resume-before-gpu-config-cuda"


def trajectory(run: Path) -> list[tuple]:
    return [tuple(json.dumps(getattr(r, k), sort_keys=True) for k in KEYS) for r in loss_records(run)]


def write_config(path: Path, **gpu: Any) -> Path:
    """The micro model in bf16 for N steps, its GEMMs timed (their plan is what a straight run
    is given), with these gpu settings."""
    path.write_text(json.dumps({**micro_config_dict(max_steps=N, precision="bf16"),
                                "gpu": {"gemm_tune": True, **gpu}}))
    return path


def stop_at_k(cfg: Path, run: Path, args: tuple[str, ...]) -> None:
    """andrea-train in `run`, SIGTERM once step K is recorded: it writes its stop checkpoint
    and exits 0, before step N."""
    proc = start_engine(cfg, run, *args)
    wait_for_step(run, K, proc)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert json.loads((run / "state.json").read_text())["status"] == "stopped"
    assert max(r.step for r in loss_records(run)) < N


def train(cfg: Path, run: Path, args: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
    """andrea-train to its end."""
    r = subprocess.run(engine_cmd(cfg, run, *args), capture_output=True, text=True,
                       timeout=300, env=dict(os.environ))
    assert r.returncode == 0, r.stdout + r.stderr
    return r


def assert_same_as_straight(tmp_path: Path, cfg: Path, run: Path, plan: str,
                            args: tuple[str, ...]) -> None:
    """N steps straight on the GPU, given the stopped run's GEMM plan (timing twice may pick
    other algorithms: the plan is what makes runs repeatable), give the very records and final
    model.ckpt bytes of the stopped and resumed `run`."""
    straight = tmp_path / "straight"
    straight.mkdir()
    (straight / "gemm_plan.json").write_text(plan)
    train(cfg, straight, args)
    state = json.loads((straight / "state.json").read_text())
    assert "sm_" in state.get("device", ""), state  # it really ran on the GPU
    assert trajectory(run) == trajectory(straight)
    ckpt = f"checkpoints/step_{N:08d}/model.ckpt"
    assert (run / ckpt).read_bytes() == (straight / ckpt).read_bytes()


def checkpoint_gpu(run: Path) -> dict[str, Any]:
    """The gpu section of the run's newest checkpoint's config."""
    states = sorted((run / "checkpoints").glob("step_*/state.json"))
    assert states, "no checkpoint"
    return json.loads(states[-1].read_text())["config"]["gpu"]


@pytest.mark.parametrize(("attention", "rows"), [("auto", True), ("classic", True),
                                                 ("auto", False)],
                         ids=["auto", "classic", "auto-qkv-slabs"])
def test_sigterm_resume_on_gpu_is_bit_exact(attention: str, rows: bool, tmp_path: Path,
                                            prepared_data: Path) -> None:
    """The GEMM algorithms are timed at the first start (gpu.gemm_tune) and recorded in
    gemm_plan.json; the resume uses the record, not a new timing. rows: gpu.qkv_rows (Q, K, V
    in rows: one GEMM each way, and the GEMM copy's W_Q, W_K, W_V side by side, rebuilt from
    the checkpoint's flat masters on resume), the same in all three runs."""
    cfg = write_config(tmp_path / "cfg.json", attention=attention, qkv_rows=rows)
    run = tmp_path / "stopped"
    stop_at_k(cfg, run, CUDA)
    plan = (run / "gemm_plan.json").read_text()
    assert json.loads(plan)["gemms"], "no GEMM was timed"
    train(cfg, run, ("--resume", *CUDA))
    log = (run / "engine.log").read_text()
    assert "GEMM algorithms from gemm_plan.json" in log, log[-2000:]
    if "attention cudnn" in log and "cuDNN refuses Q, K, V in rows" not in log:
        # where cuDNN runs (and takes the rows), the Q, K, V layout is the one asked for
        assert ("Q, K, V in rows, one GEMM" in log) == rows, log[-2000:]
    assert (run / "gemm_plan.json").read_text() == plan  # the resume kept it
    assert_same_as_straight(tmp_path, cfg, run, plan, CUDA)


@pytest.mark.parametrize("first, then", [("cuda", "numpy"), ("numpy", "cuda")])
def test_checkpoint_moves_between_gpu_and_cpu(first: str, then: str, tmp_path: Path,
                                              prepared_data: Path) -> None:
    """A checkpoint written on one backend resumes on the other (DESIGN §6 is backend-free).
    fp32 on both sides, so the resumed losses track a straight GPU run closely (bound 1e-3
    absolute over the steps after the switch; measured fp32 agreement is ~1e-6 per step)."""
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps(micro_config_dict(max_steps=N, precision="fp32")))
    straight = tmp_path / "straight"
    assert run_engine(cfg, straight, *CUDA).returncode == 0
    run2 = tmp_path / "half"
    proc = start_engine(cfg, run2, "--backend", first)
    wait_for_step(run2, K, proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 0
    k = max(r.step for r in loss_records(run2))
    r = run_engine(cfg, run2, "--resume", "--backend", then)
    assert r.returncode == 0, r.stdout + r.stderr
    state = json.loads((run2 / "state.json").read_text())
    assert state["backend"] == then and state["status"] == "finished"
    ref = {x.step: x.loss for x in loss_records(straight)}
    got = {x.step: x.loss for x in loss_records(run2)}
    assert sorted(got) == list(range(1, N + 1))
    assert max(abs(got[s] - ref[s]) for s in range(k + 1, N + 1)) < 1e-3


def test_a_resume_computes_with_the_run_s_own_gpu_section(tmp_path: Path,
                                                        prepared_data: Path) -> None:
    """A run started with a choice off its default (the logits in float32) keeps it in its
    checkpoints' config; resumed with a config that says nothing of it, it runs on with the
    run's: bit for bit the run straight with that choice, and the given config's other value is
    named among the settings not used."""
    cfg = write_config(tmp_path / "cfg.json", logits_low_precision=False)
    run = tmp_path / "stopped"
    stop_at_k(cfg, run, CUDA)
    assert checkpoint_gpu(run)["logits_low_precision"] is False
    plan = (run / "gemm_plan.json").read_text()
    given = write_config(tmp_path / "given.json")
    r = train(given, run, ("--resume", *CUDA))
    assert "gpu.logits_low_precision: false (kept) -- given true" in r.stderr, r.stderr
    log = (run / "engine.log").read_text()
    starts = [line for line in log.splitlines() if re.search(r"cuda: attention .*; GEMMs", line)]
    assert len(starts) == 2, log[-3000:]  # the start and the resume: float32 logits in both
    assert not any("logits in bf16" in s for s in starts), starts
    assert_same_as_straight(tmp_path, cfg, run, plan, CUDA)


def test_a_resume_keeps_the_run_s_attention_chunk(tmp_path: Path, prepared_data: Path) -> None:
    """The classic attention's chunk (gpu.attention_chunk, the shapes of its GEMMs) is the
    run's: started with 16, resumed with a config that says nothing of it, the run goes on with
    16, bit for bit the run straight with it."""
    cfg = write_config(tmp_path / "cfg.json", attention="classic", attention_chunk=16)
    run = tmp_path / "stopped"
    stop_at_k(cfg, run, CUDA)
    plan = (run / "gemm_plan.json").read_text()
    train(write_config(tmp_path / "given.json"), run, ("--resume", *CUDA))
    final = checkpoint_gpu(run)  # what the resumed run's own checkpoint holds
    assert final["attention"] == "classic" and final["attention_chunk"] == 16, final
    assert_same_as_straight(tmp_path, cfg, run, plan, CUDA)


def test_a_checkpoint_from_before_the_gpu_section_resumes_bit_for_bit(tmp_path: Path) -> None:
    """The GPU fixture (written by the engine before the config had a gpu section, its state
    recording the CUDA switches as `cuda_settings`): resumed at its checkpoint, the run writes
    the step records of its straight run, through the one translation of the old record."""
    if not (FIXTURE / "run").is_dir():
        pytest.skip(f"no GPU fixture at {FIXTURE.relative_to(FIXTURES.parent.parent)}")
    from engine.backends.cuda.runtime import Gpu

    if not (FIXTURE / "run" / "gemm_plan.json").is_file():
        pytest.skip("the GPU fixture has no run/gemm_plan.json: a resume would time its GEMMs "
                    "afresh, and its bits would depend on that timing")
    config, run = install(FIXTURE, tmp_path / "fixture")
    precision = json.loads(config.read_text())["train"]["precision"]
    plan = json.loads((run / "gemm_plan.json").read_text())
    here = Gpu.get().describe(precision)
    if plan.get("device") != here:
        pytest.skip(f"the fixture's GEMM plan is from {plan.get('device')}, this GPU is {here}")
    first = min(int(p.name.split("_")[1]) for p in (run / "checkpoints").glob("step_*"))
    r = train(config, run, ("--resume", *CUDA))
    log = (run / "engine.log").read_text()
    assert "its run's settings go on as gpu:" in log, log[-3000:] + r.stderr
    assert step_records(run / "loss.jsonl") == step_records(FIXTURE / "loss.jsonl")[first:]
