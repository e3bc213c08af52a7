"""train/precision fp8 on the numpy backend (engine/backends/numpy/fp8.py): the MLP's GEMMs on
FP8 values with delayed scaling, against the fp32 step; the amax history each pass records;
validation untouched; and, through real engine processes, a stop and resume that goes on from
the checkpoint's history bit for bit, and a resume from a checkpoint without one that says so."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import numpy as np
import pytest

from engine import records as rec
from engine.backends.numpy import NumpyBackend
from engine.backends.numpy.fp8 import SCALES
from engine.model.fp8 import (
    DELAYED,
    E4M3,
    E5M2,
    HISTORY,
    AmaxHistory,
    amax_of,
    round_fp8,
    scale_for,
)
from engine.model.layout import ModelShapes, init_params
from tests.conftest import loss_records, micro_config_dict, run_engine, start_engine, wait_for_step

SHAPES = ModelShapes(n_layer=2, d_model=64, n_head=2, d_ff=256, vocab_size=300, seq_len=32)


def backend(precision: str) -> NumpyBackend:
    bk = NumpyBackend(SHAPES, 4, precision)
    bk.load_params(init_params(SHAPES, seed=1))
    return bk


def tokens(seed: int) -> tuple[np.ndarray, np.ndarray]:
    tok = np.random.default_rng(seed).integers(0, SHAPES.vocab_size, (4, 33))
    return tok[:, :-1], tok[:, 1:]


def step(bk: NumpyBackend, seed: int) -> tuple[np.ndarray, np.ndarray]:
    bk.zero_grads()
    rows = bk.forward_backward(*tokens(seed))
    return rows, bk.read_grads().astype(np.float64)


def test_the_fp8_step_follows_the_fp32_step() -> None:
    (r32, g32), (r8, g8) = step(backend("fp32"), 0), step(backend("fp8"), 0)
    assert not np.array_equal(r8, r32)  # the MLP did run on FP8 values
    assert abs(r8.mean() - r32.mean()) <= 1e-2 * r32.mean()
    assert g8 @ g32 / (np.linalg.norm(g8) * np.linalg.norm(g32)) >= 0.99
    assert abs(np.linalg.norm(g8) / np.linalg.norm(g32) - 1) <= 0.05


def test_the_first_pass_scales_by_the_amax_now_and_later_ones_by_the_history() -> None:
    bk = backend("fp8")
    f = bk.fp8
    step(bk, 0)
    first = f.history.amax[:, 0].copy()
    assert f.history.next == 1 and (first > 0).all()
    # pass 1 had no history: each scale is its own amax's (E5M2's for dy and dh, else E4M3's)
    assert SCALES == DELAYED
    for layer in range(SHAPES.n_layer):
        for col, tensor in enumerate(DELAYED):
            fmt = E5M2 if tensor.startswith("d") else E4M3
            assert f.scales[layer, col] == scale_for(first[f.history.row(layer, tensor)], fmt)
    step(bk, 1)
    second = f.history.amax[:, 1].copy()
    # some tensor's amax grew: its pass-2 scale is still pass 1's (not the larger one's now)
    assert (second > first).any() and (second < first).any()
    for layer in range(SHAPES.n_layer):
        for col, tensor in enumerate(DELAYED):
            fmt = E5M2 if tensor.startswith("d") else E4M3
            # pass 2: the largest amax in the history (pass 1's), not its own
            assert f.scales[layer, col] == scale_for(first[f.history.row(layer, tensor)], fmt)


def test_a_weights_scale_comes_from_the_amax_its_last_passes_recorded() -> None:
    """The weights are delayed tensors too: pass 1 (no history) scales W1 and W2 by their amax
    then; W1 grown and W2 shrunk before pass 2, pass 2 still scales them by pass 1's amax and
    records their amax now, which pass 3 scales W1 by (the larger)."""
    bk = backend("fp8")
    f, p = bk.fp8, bk.p
    w = {"w1": p["h.1.mlp.W_1"], "w2": p["h.1.mlp.W_2"]}
    col = {k: SCALES.index(k) for k in w}
    step(bk, 0)
    first = {k: amax_of(v) for k, v in w.items()}
    for k in w:
        assert f.scales[1, col[k]] == scale_for(first[k], E4M3)
        assert f.history.amax[f.history.row(1, k), 0] == first[k]
    w["w1"] *= np.float32(3.0)
    w["w2"] *= np.float32(0.25)
    now = {k: amax_of(v) for k, v in w.items()}
    step(bk, 0)
    for k in w:
        assert now[k] != first[k]
        assert f.scales[1, col[k]] == scale_for(first[k], E4M3) != scale_for(now[k], E4M3)
        assert f.history.amax[f.history.row(1, k), 1] == now[k]
        assert f.history.delayed_amax(1, k) == max(first[k], now[k])
    # pass 3 scales W1 by the larger amax (pass 2's) and W2 by pass 1's, still the larger
    step(bk, 0)
    assert f.scales[1, col["w1"]] == scale_for(now["w1"], E4M3)
    assert f.scales[1, col["w2"]] == scale_for(first["w2"], E4M3)


def test_the_fp8_gemm_is_the_product_of_the_fp8_values_times_the_inverse_scales() -> None:
    bk = backend("fp8")
    x = np.random.default_rng(3).standard_normal((128, 64)).astype(np.float32)
    p = bk.p
    pre, act = np.zeros((128, 256), np.float32), np.zeros((128, 256), np.float32)
    out = np.zeros((128, 64), np.float32)
    bk.fp8.begin_pass()
    bk.fp8.forward(0, x, p["h.0.mlp.W_1"], p["h.0.mlp.W_2"], pre, act, out)
    sx, sw = bk.fp8.scales[0, SCALES.index("x")], bk.fp8.scales[0, SCALES.index("w1")]
    xq = round_fp8(x * sx, E4M3).astype(np.float64)
    wq = round_fp8(p["h.0.mlp.W_1"] * sw, E4M3).astype(np.float64)
    want = xq @ wq / (np.float64(sx) * np.float64(sw))
    assert np.abs(pre - want).max() <= 1e-5 * np.abs(want).max()
    exact = x.astype(np.float64) @ p["h.0.mlp.W_1"].astype(np.float64)
    err = np.linalg.norm(pre - exact) / np.linalg.norm(exact)
    assert 1e-3 < err < 0.1  # FP8's rounding, and no more


def test_validation_runs_the_plain_forward_and_leaves_the_history() -> None:
    bk, ref = backend("fp8"), backend("fp32")
    step(bk, 0)
    before = (bk.fp8.history.amax.copy(), bk.fp8.history.next)
    x, y = tokens(5)
    assert np.array_equal(bk.forward_loss(x, y), ref.forward_loss(x, y))
    assert np.array_equal(bk.fp8.history.amax, before[0]) and bk.fp8.history.next == before[1]


def test_a_loaded_history_changes_the_next_pass_and_a_foreign_one_is_refused() -> None:
    a, b = backend("fp8"), backend("fp8")
    for seed in range(3):
        step(a, seed)
    saved = a.fp8_history()
    assert saved is not None and saved.next == 3
    raw = json.loads(json.dumps(saved.to_json()))
    b.load_fp8_history(AmaxHistory.from_json(raw, 2).history)
    same = step(b, 7)
    a.load_fp8_history(None)  # afresh: pass 4 then scales by its own amax
    afresh = step(a, 7)
    b2 = backend("fp8")
    b2.load_fp8_history(saved)
    assert np.array_equal(step(b2, 7)[0], same[0])
    assert not np.array_equal(afresh[0], same[0])
    with pytest.raises(ValueError, match="expected 12 tensors x 16 passes"):
        a.load_fp8_history(AmaxHistory.empty(n_layer=3))
    assert backend("fp32").fp8_history() is None


# ---------------------------------------------------------------- through the engine

N = 24  # steps; with grad_accum 2, 48 passes: the history of 16 wraps three times


def fp8_config(tmp_path: Path, name: str = "fp8.json", **train) -> Path:
    c = micro_config_dict(max_steps=N, grad_accum=2, precision="fp8", **train)
    path = tmp_path / name
    path.write_text(json.dumps(c))
    return path


def trajectory(run: Path) -> list[tuple]:
    return [(r.step, r.loss, r.grad_norm, r.clip_scale) for r in loss_records(run)]


def model_bytes(run: Path, step: int) -> bytes:
    return (run / "checkpoints" / f"step_{step:08d}" / "model.ckpt").read_bytes()


@pytest.mark.slow
def test_stop_and_resume_in_fp8_goes_on_from_the_history_bit_for_bit(
        tmp_path: Path, prepared_data: Path) -> None:
    cfg = fp8_config(tmp_path)
    straight = tmp_path / "straight"
    r = run_engine(cfg, straight, "--backend", "numpy")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "FP8 values (delayed scaling)" in (straight / "engine.log").read_text()
    run = tmp_path / "stopped"
    proc = start_engine(cfg, run, "--backend", "numpy")
    wait_for_step(run, 11, proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 0
    stop = json.loads((run / "state.json").read_text())["last_checkpoint"]
    ckpt = json.loads((run / "checkpoints" / Path(stop["path"]).name / "state.json").read_text())
    hist, without = AmaxHistory.from_json(ckpt[rec.STATE_FP8_HISTORY], 2)
    assert without == ()
    assert hist.next == (2 * stop["step"]) % HISTORY and (hist.amax > 0).any()
    r = run_engine(cfg, run, "--resume", "--backend", "numpy")
    assert r.returncode == 0, r.stdout + r.stderr
    assert trajectory(run) == trajectory(straight)
    assert model_bytes(run, N) == model_bytes(straight, N)
    assert "FP8 amax history starts afresh" not in (run / "engine.log").read_text()


@pytest.mark.slow
def test_a_checkpoint_without_a_history_resumes_in_fp8_and_the_log_says_so(
        tmp_path: Path, prepared_data: Path) -> None:
    c = micro_config_dict(max_steps=10, precision="fp32")
    cfg = tmp_path / "fp32.json"
    cfg.write_text(json.dumps(c))
    run = tmp_path / "run"
    r = run_engine(cfg, run, "--backend", "numpy")
    assert r.returncode == 0, r.stdout + r.stderr
    r = run_engine(cfg, run, "--resume", "--backend", "numpy", "--precision", "fp8",
                   "--max-steps", "14")
    assert r.returncode == 0, r.stdout + r.stderr
    log = (run / "engine.log").read_text()
    assert "resume: FP8 amax history starts afresh: the checkpoint has none" in log, log[-3000:]
    assert loss_records(run)[-1].step == 14
    last = json.loads((run / "checkpoints" / "step_00000014" / "state.json").read_text())
    assert AmaxHistory.from_json(last[rec.STATE_FP8_HISTORY], 2).history.next == 4


@pytest.mark.slow
def test_a_checkpoint_whose_history_lacks_the_weights_resumes_and_the_log_says_so(
        tmp_path: Path, prepared_data: Path) -> None:
    """A checkpoint written while the weights were scaled by their own amax each pass: its
    state.json's history holds x, h, dy and dh only. The resume goes on from those rows, the
    weights' rows starting empty (filled from the resumed passes on), and engine.log says so."""
    from engine.run.checkpoint import state_digest

    cfg = fp8_config(tmp_path)
    run = tmp_path / "run"
    r = run_engine(cfg, run, "--backend", "numpy", "--max-steps", "10")
    assert r.returncode == 0, r.stdout + r.stderr
    state_path = run / "checkpoints" / "step_00000010" / "state.json"
    doc = json.loads(state_path.read_text())
    full = AmaxHistory.from_json(doc[rec.STATE_FP8_HISTORY], 2).history
    assert full.next == 20 % HISTORY and (full.amax > 0).all()  # 20 passes: every slot written
    old = full.amax.reshape(2, len(DELAYED), HISTORY)[:, :4]  # x, h, dy, dh of each layer
    doc[rec.STATE_FP8_HISTORY] = {"tensors": ["x", "h", "dy", "dh"], "length": HISTORY,
                                  "next": full.next,
                                  "amax_bits": [int(b) for b in old.view(np.uint32).ravel()]}
    doc["state_sha256"] = state_digest(doc)
    state_path.write_text(json.dumps(doc, indent=1))
    r = run_engine(cfg, run, "--resume", "--backend", "numpy", "--max-steps", "14")
    assert r.returncode == 0, r.stdout + r.stderr
    log = (run / "engine.log").read_text()
    assert ("resume: the checkpoint's FP8 amax history has no rows for the weights (w1, w2; "
            "written by an engine that scaled them by their own amax each pass)") in log, \
        log[-3000:]
    assert "FP8 amax history starts afresh" not in log
    assert loss_records(run)[-1].step == 14
    last = json.loads((run / "checkpoints" / "step_00000014" / "state.json").read_text())
    got, without = AmaxHistory.from_json(last[rec.STATE_FP8_HISTORY], 2)
    assert without == () and got.next == 28 % HISTORY
    resumed = [(full.next + k) % HISTORY for k in range(8)]  # the 8 passes of steps 11..14
    kept = [k for k in range(HISTORY) if k not in resumed]
    for layer in range(2):
        for t, tensor in enumerate(DELAYED):
            row = got.amax[got.row(layer, tensor)]
            assert (row[resumed] > 0).all()
            if t < 4:  # the checkpoint's rows, in place where no resumed pass wrote
                assert np.array_equal(row[kept], old[layer, t, kept])
            else:  # no history but the resumed passes'
                assert not row[kept].any()


def test_an_mlp_narrower_than_the_model_runs_in_fp8() -> None:
    """d_ff below d_model: the FP8 copies' buffers hold x and dy [N, d] too."""
    shapes = ModelShapes(n_layer=1, d_model=64, n_head=2, d_ff=32, vocab_size=300, seq_len=32)
    bk = NumpyBackend(shapes, 4, "fp8")
    bk.load_params(init_params(shapes, seed=2))
    bk.zero_grads()
    x, y = tokens(0)
    assert np.isfinite(bk.forward_backward(x, y)).all() and np.isfinite(bk.read_grads()).all()
