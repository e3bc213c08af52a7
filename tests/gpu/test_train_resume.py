"""andrea-train on the CUDA backend: SIGTERM at step k and --resume gives, bit for bit, the same
loss records and final model.ckpt as N steps straight (DESIGN §6)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from engine.records import cuda_settings_of
from tests.conftest import (
    engine_cmd,
    loss_records,
    micro_config_dict,
    run_engine,
    start_engine,
    wait_for_step,
)

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

N, K = 30, 17
CUDA = ("--backend", "cuda")
KEYS = ("step", "loss", "grad_norm", "clip_scale", "lr", "tokens", "phase", "weights", "src_loss")


def trajectory(run: Path) -> list[tuple]:
    return [tuple(json.dumps(getattr(r, k), sort_keys=True) for k in KEYS) for r in loss_records(run)]


def settings_free_env() -> dict[str, str]:
    """The test's environment without its ANDREA_* settings (one bisecting ANDREA_FUSIONS=0
    away would take the setting under test with it), the cubin cache and device kept, and the
    GEMMs timed (their plan is what a straight run is given)."""
    keep = ("ANDREA_CUBIN_CACHE", "ANDREA_CUDA_DEVICE")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANDREA_") or k in keep}
    return {**env, "ANDREA_GEMM_TUNE": "1"}


def stop_at_k(cfg: Path, run: Path, args: tuple[str, ...], env: dict[str, str]) -> None:
    """andrea-train in `run` with exactly the environment `env`, SIGTERM once step K is
    recorded: it writes its stop checkpoint and exits 0, before step N."""
    proc = start_engine(cfg, run, *args, env=env)
    wait_for_step(run, K, proc)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert json.loads((run / "state.json").read_text())["status"] == "stopped"
    assert max(r.step for r in loss_records(run)) < N


def train(cfg: Path, run: Path, args: tuple[str, ...], env: dict[str, str]) -> None:
    """andrea-train to its end with exactly the environment `env`."""
    r = subprocess.run(engine_cmd(cfg, run, *args), capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 0, r.stdout + r.stderr


def assert_same_as_straight(tmp_path: Path, cfg: Path, run: Path, plan: str,
                            args: tuple[str, ...], env: dict[str, str]) -> None:
    """N steps straight on the GPU, given the stopped run's GEMM plan (timing twice may pick
    other algorithms: the plan is what makes runs repeatable), give the very records and final
    model.ckpt bytes of the stopped and resumed `run`."""
    straight = tmp_path / "straight"
    straight.mkdir()
    (straight / "gemm_plan.json").write_text(plan)
    train(cfg, straight, args, env)
    state = json.loads((straight / "state.json").read_text())
    assert "sm_" in state.get("device", ""), state  # it really ran on the GPU
    assert trajectory(run) == trajectory(straight)
    ckpt = f"checkpoints/step_{N:08d}/model.ckpt"
    assert (run / ckpt).read_bytes() == (straight / ckpt).read_bytes()


@pytest.mark.parametrize(("attention", "rows"), [("auto", "1"), ("classic", "1"), ("auto", "0")],
                         ids=["auto", "classic", "auto-qkv-slabs"])
def test_sigterm_resume_on_gpu_is_bit_exact(attention: str, rows: str, tmp_path: Path,
                                            prepared_data: Path) -> None:
    """The GEMM algorithms are timed at the first start (ANDREA_GEMM_TUNE=1) and recorded in
    gemm_plan.json; the resume uses the record, not a new timing. The straight run is given the
    same plan (timing twice may pick differently: the plan is what makes runs repeatable).
    rows: ANDREA_QKV_ROWS (Q, K, V in rows: one GEMM each way, and the GEMM copy's W_Q, W_K,
    W_V side by side, rebuilt from the checkpoint's flat masters on resume), the same in all
    three runs."""
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps(micro_config_dict(max_steps=N, precision="bf16")))
    args = (*CUDA, "--attention", attention)
    env = {**os.environ, "ANDREA_GEMM_TUNE": "1", "ANDREA_QKV_ROWS": rows}
    run = tmp_path / "stopped"
    stop_at_k(cfg, run, args, env)
    plan = (run / "gemm_plan.json").read_text()
    assert json.loads(plan)["gemms"], "no GEMM was timed"
    train(cfg, run, ("--resume", *args), env)
    log = (run / "engine.log").read_text()
    assert "GEMM algorithms from gemm_plan.json" in log, log[-2000:]
    if "attention cudnn" in log and "cuDNN refuses Q, K, V in rows" not in log:
        # where cuDNN runs (and takes the rows), the Q, K, V layout is the one asked for
        assert ("(ANDREA_QKV_ROWS)" in log) == (rows == "1"), log[-2000:]
    assert (run / "gemm_plan.json").read_text() == plan  # the resume kept it
    assert_same_as_straight(tmp_path, cfg, run, plan, args, env)


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


def test_resume_takes_up_the_runs_recorded_switches(tmp_path: Path, prepared_data: Path) -> None:
    """A run started with a switch off its default (ANDREA_RESID_GEMM=1) records it in its
    checkpoints' state.json (`cuda_settings`); resumed with nothing in the environment, it runs
    on with it: bit for bit the run straight with the switch set. A resume told otherwise by the
    environment says so in engine.log (and then computes other bits)."""
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps(micro_config_dict(max_steps=N, precision="bf16")))
    base = settings_free_env()
    on = {**base, "ANDREA_RESID_GEMM": "1"}
    run = tmp_path / "stopped"
    stop_at_k(cfg, run, CUDA, on)
    states = sorted((run / "checkpoints").glob("step_*/state.json"))
    assert states, "no checkpoint"
    settings = cuda_settings_of(json.loads(states[-1].read_text()))
    assert settings["ANDREA_RESID_GEMM"] is True and settings["attention"] in ("cudnn", "classic")
    plan = (run / "gemm_plan.json").read_text()
    train(cfg, run, ("--resume", *CUDA), base)  # nothing said: the record's switch
    log = (run / "engine.log").read_text()
    assert "the run's CUDA settings from the checkpoint" in log, log[-2000:]
    starts = [line for line in log.splitlines() if re.search(r"cuda: attention .*; GEMMs", line)]
    assert len(starts) == 2, log[-3000:]  # the start and the resume: both with the switch on
    assert all("residual adds in the GEMM epilogues (ANDREA_RESID_GEMM)" in s for s in starts)
    assert_same_as_straight(tmp_path, cfg, run, plan, CUDA, on)

    # told otherwise: the environment wins, and the log says the bits now differ
    train(cfg, run, ("--resume", "--max-steps", str(N + 3), *CUDA),
          {**base, "ANDREA_RESID_GEMM": "0"})
    log = (run / "engine.log").read_text()
    assert "ANDREA_RESID_GEMM=0 from the environment, where the run recorded 1" in log, log[-2000:]


def test_resume_takes_up_the_recorded_attention_chunk(tmp_path: Path,
                                                       prepared_data: Path) -> None:
    """The classic attention's chunk (ANDREA_ATTN_CHUNK, the shapes of its GEMMs) is recorded
    with the run as the switches are: started with 16, resumed with nothing said, the run goes
    on with 16, bit for bit the run straight with it."""
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps(micro_config_dict(max_steps=N, precision="bf16")))
    base = settings_free_env()
    chunked = {**base, "ANDREA_ATTN_CHUNK": "16"}
    args = (*CUDA, "--attention", "classic")
    run = tmp_path / "stopped"
    stop_at_k(cfg, run, args, chunked)
    states = sorted((run / "checkpoints").glob("step_*/state.json"))
    settings = cuda_settings_of(json.loads(states[-1].read_text()))
    assert settings["attention"] == "classic" and settings["ANDREA_ATTN_CHUNK"] == 16, settings
    plan = (run / "gemm_plan.json").read_text()
    train(cfg, run, ("--resume", *CUDA), base)
    log = (run / "engine.log").read_text()
    taken = [x for x in log.splitlines() if "the run's CUDA settings from the checkpoint" in x]
    assert taken and "ANDREA_ATTN_CHUNK=16" in taken[-1], log[-2000:]
    last = json.loads((run / "checkpoints" / f"step_{N:08d}" / "state.json").read_text())
    final = cuda_settings_of(last)  # what the resumed run's own checkpoint records
    assert final["attention"] == "classic" and final["ANDREA_ATTN_CHUNK"] == 16, final
    assert_same_as_straight(tmp_path, cfg, run, plan, args, chunked)
