"""train/precision fp8 on the numpy backend (engine/backends/numpy/fp8.py): each layer's linear
maps (qkv, proj, the MLP's fc1 and fc2) on FP8 values with delayed scaling, each GEMM against
the product of FP8 values computed here, and the step against the fp32 step; the amax history
each pass records; validation untouched; and, through real engine processes, a stop and resume
that goes on from the checkpoint's history bit for bit, and resumes from checkpoints without
one or with fewer tensors' rows that say so."""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest

from engine import records as rec
from engine.backends.numpy import NumpyBackend, ops
from engine.backends.numpy.fp8 import SCALES, Fp8Gemms
from engine.model.fp8 import (
    DELAYED,
    E4M3,
    E5M2,
    HISTORY,
    AmaxHistory,
    Fp8Format,
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
    assert not np.array_equal(r8, r32)  # the linear maps did run on FP8 values
    assert abs(r8.mean() - r32.mean()) <= 1e-2 * r32.mean()
    assert g8 @ g32 / (np.linalg.norm(g8) * np.linalg.norm(g32)) >= 0.99
    assert abs(np.linalg.norm(g8) / np.linalg.norm(g32) - 1) <= 0.05


def test_the_first_pass_scales_by_the_amax_now_and_later_ones_by_the_history() -> None:
    bk = backend("fp8")
    f = bk.fp8
    step(bk, 0)
    first = f.history.amax[:, 0].copy()
    assert f.history.next == 1 and (first > 0).all()
    # pass 1 had no history: each scale is its own amax's (E5M2's for the gradients dy, dh,
    # dproj and dqkv, else E4M3's)
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
    """The weights are delayed tensors too: pass 1 (no history) scales W1, W2, W_Q|W_K|W_V and
    W_O by their amax then; W1 and W_Q|W_K|W_V grown and W2 and W_O shrunk before pass 2, pass 2
    still scales them by pass 1's amax and records their amax now, which pass 3 scales the grown
    ones by (the larger)."""
    bk = backend("fp8")
    f, p = bk.fp8, bk.p
    # bk._wqkv[1]: layer 1's W_Q, W_K, W_V [3, d, d], a view of the weights as they lie
    w = {"w1": p["h.1.mlp.W_1"], "w2": p["h.1.mlp.W_2"], "wqkv": bk._wqkv[1],
         "wo": p["h.1.attn.W_O"]}
    grown = ("w1", "wqkv")
    col = {k: SCALES.index(k) for k in w}
    step(bk, 0)
    first = {k: amax_of(v) for k, v in w.items()}
    for k in w:
        assert f.scales[1, col[k]] == scale_for(first[k], E4M3)
        assert f.history.amax[f.history.row(1, k), 0] == first[k]
    for k in w:
        w[k] *= np.float32(3.0 if k in grown else 0.25)
    now = {k: amax_of(v) for k, v in w.items()}
    step(bk, 0)
    for k in w:
        assert now[k] != first[k]
        assert f.scales[1, col[k]] == scale_for(first[k], E4M3) != scale_for(now[k], E4M3)
        assert f.history.amax[f.history.row(1, k), 1] == now[k]
        assert f.history.delayed_amax(1, k) == max(first[k], now[k])
    # pass 3 scales the grown by the larger amax (pass 2's), the shrunk by pass 1's (the larger)
    step(bk, 0)
    for k in w:
        assert f.scales[1, col[k]] == scale_for(now[k] if k in grown else first[k], E4M3)


def test_the_fc1_gemm_is_the_product_of_the_fp8_values_times_the_inverse_scales() -> None:
    bk = backend("fp8")
    x = np.random.default_rng(3).standard_normal((128, 64)).astype(np.float32)
    p = bk.p
    pre, act = np.zeros((128, 256), np.float32), np.zeros((128, 256), np.float32)
    out = np.zeros((128, 64), np.float32)
    bk.fp8.begin_pass()
    bk.fp8.mlp_forward(0, x, p["h.0.mlp.W_1"], p["h.0.mlp.W_2"], pre, act, out)
    sx, sw = bk.fp8.scales[0, SCALES.index("x")], bk.fp8.scales[0, SCALES.index("w1")]
    xq = round_fp8(x * sx, E4M3).astype(np.float64)
    wq = round_fp8(p["h.0.mlp.W_1"] * sw, E4M3).astype(np.float64)
    want = xq @ wq / (np.float64(sx) * np.float64(sw))
    assert np.abs(pre - want).max() <= 1e-5 * np.abs(want).max()
    exact = x.astype(np.float64) @ p["h.0.mlp.W_1"].astype(np.float64)
    err = np.linalg.norm(pre - exact) / np.linalg.norm(exact)
    assert 1e-3 < err < 0.1  # FP8's rounding, and no more


def fp8_values(x: np.ndarray, fmt: Fp8Format) -> tuple[np.ndarray, np.float64]:
    """fp8(x·s) as float64 and s, for a tensor with no history: s = FMAX / max |x|."""
    s = scale_for(np.float32(np.abs(x).max()), fmt)
    return round_fp8(x.astype(np.float32) * s, fmt).astype(np.float64), np.float64(s)


def assert_close(got: np.ndarray, want: np.ndarray) -> None:
    """got (float32, numpy's sums) is want (float64) to float32's rounding of the sums."""
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def scratch(N: int, d: int) -> tuple[np.ndarray, np.ndarray]:
    """xtmp [N, d] and a flat wtmp of 3·d·d."""
    return np.zeros((N, d), np.float32), np.zeros(3 * d * d, np.float32)


def test_qkv_is_the_product_of_the_fp8_values_with_one_scale_for_w_q_w_k_and_w_v() -> None:
    """qkv[j] = fp8(ln1·s_ln1) · fp8(W_j·s_w) / (s_ln1·s_w), s_w from the largest |entry| of
    W_Q, W_K and W_V together (here W_K's, its entries 10x the others'); the backward's
    dW_j += fp8(ln1)ᵀ · fp8(dqkv[j]) / (s_ln1·s_dqkv) and dx = Σ_j fp8(dqkv[j]) · fp8(W_j)ᵀ /
    (s_dqkv·s_w), dqkv in E5M2 with one scale for its three parts (dV's here 10x the others')."""
    N, d = 128, 64
    rng = np.random.default_rng(4)
    ln1 = rng.standard_normal((N, d)).astype(np.float32)
    wqkv = (0.02 * rng.standard_normal((3, d, d))).astype(np.float32)
    wqkv[1] *= np.float32(10.0)
    dqkv = (1e-3 * rng.standard_normal((3, N, d))).astype(np.float32)
    dqkv[2] *= np.float32(10.0)
    dw0 = (1e-3 * rng.standard_normal((3, d, d))).astype(np.float32)
    f = Fp8Gemms(1, d, 256, N, np.dtype(np.float32))
    f.begin_pass()
    qkv = np.zeros((3, N, d), np.float32)
    f.qkv_forward(0, ln1, wqkv, qkv)
    l8, sl = fp8_values(ln1, E4M3)
    w8, sw = fp8_values(wqkv, E4M3)
    # one scale for the three: W_K's amax, not W_Q's own
    assert sw == scale_for(np.float32(np.abs(wqkv[1]).max()), E4M3)
    assert sw != scale_for(np.float32(np.abs(wqkv[0]).max()), E4M3)
    assert f.scales[0, SCALES.index("ln1")] == sl and f.scales[0, SCALES.index("wqkv")] == sw
    for j in range(3):
        assert_close(qkv[j], l8 @ w8[j] / (sl * sw))
    # W_Q's copy by its own amax would have given other values than these
    q_own, s_own = fp8_values(wqkv[0], E4M3)
    own = l8 @ q_own / (sl * s_own)
    assert np.abs(qkv[0] - own).max() > 1e-3 * np.abs(own).max()

    dx = np.zeros((N, d), np.float32)
    dw = dw0.copy()
    f.qkv_backward(0, dqkv, ln1, wqkv, dx, dw, *scratch(N, d))
    g8, sg = fp8_values(dqkv, E5M2)
    assert sg == scale_for(np.float32(np.abs(dqkv[2]).max()), E5M2)
    assert f.scales[0, SCALES.index("dqkv")] == sg
    for j in range(3):
        assert_close(dw[j], dw0[j] + l8.T @ g8[j] / (sl * sg))
    assert_close(dx, sum(g8[j] @ w8[j].T for j in range(3)) / (sg * sw))
    exact = sum(dqkv[j].astype(np.float64) @ wqkv[j].T.astype(np.float64) for j in range(3))
    assert 1e-3 < np.linalg.norm(dx - exact) / np.linalg.norm(exact) < 0.1
    # the pass's amax of each: one for ln1, one for the three weights, one for the three grads
    f.end_pass()
    for t, x in (("ln1", ln1), ("wqkv", wqkv), ("dqkv", dqkv)):
        assert f.history.amax[f.history.row(0, t), 0] == np.abs(x).max()


def test_proj_is_the_product_of_the_fp8_values_times_the_inverse_scales() -> None:
    """out = fp8(att·s_att) · fp8(W_O·s_wo) / (s_att·s_wo); the backward's
    dW_O += fp8(att)ᵀ · fp8(dproj) / (s_att·s_dproj) and datt = fp8(dproj) · fp8(W_O)ᵀ /
    (s_dproj·s_wo), dproj (proj's output gradient) in E5M2."""
    N, d = 128, 64
    rng = np.random.default_rng(5)
    att = (0.3 * rng.standard_normal((N, d))).astype(np.float32)
    wo = (0.02 * rng.standard_normal((d, d))).astype(np.float32)
    dout = (1e-4 * rng.standard_normal((N, d))).astype(np.float32)
    dw0 = (1e-4 * rng.standard_normal((d, d))).astype(np.float32)
    f = Fp8Gemms(1, d, 256, N, np.dtype(np.float32))
    f.begin_pass()
    out = np.zeros((N, d), np.float32)
    f.proj_forward(0, att, wo, out)
    a8, sa = fp8_values(att, E4M3)
    w8, sw = fp8_values(wo, E4M3)
    assert f.scales[0, SCALES.index("att")] == sa and f.scales[0, SCALES.index("wo")] == sw
    assert_close(out, a8 @ w8 / (sa * sw))
    exact = att.astype(np.float64) @ wo.astype(np.float64)
    assert 1e-3 < np.linalg.norm(out - exact) / np.linalg.norm(exact) < 0.1

    datt = np.zeros((N, d), np.float32)
    dw = dw0.copy()
    f.proj_backward(0, dout, att, wo, datt, dw, scratch(N, d)[1])
    g8, sg = fp8_values(dout, E5M2)
    assert f.scales[0, SCALES.index("dproj")] == sg
    assert_close(dw, dw0 + a8.T @ g8 / (sa * sg))
    assert_close(datt, g8 @ w8.T / (sg * sw))
    f.end_pass()
    for t, x in (("att", att), ("wo", wo), ("dproj", dout)):
        assert f.history.amax[f.history.row(0, t), 0] == np.abs(x).max()


def test_one_pass_records_the_amax_of_every_delayed_tensor_of_every_layer(monkeypatch) -> None:
    """After one training pass, each layer's row of each DELAYED tensor holds max |tensor|:
    the activations from the saved ones, the weights from the masters, the gradients as the
    backward's own ops hand them on (dy: the LayerNorm's or the residual's output gradient
    entering the block, dproj: the residual stream's after the MLP, dqkv: attention's backward
    output, dh: the GELU backward's output)."""
    seen: dict[str, list[np.ndarray]] = {"ln": [], "res": [], "attn": [], "gelu": []}

    def spy(name: str, fn, out: int):
        def call(*args) -> None:
            fn(*args)
            seen[name].append(np.array(args[out], np.float64))

        return call

    monkeypatch.setattr(ops, "layernorm_bwd", spy("ln", ops.layernorm_bwd, 5))
    monkeypatch.setattr(ops, "residual_add_bwd", spy("res", ops.residual_add_bwd, 1))
    monkeypatch.setattr(ops, "attn_bwd", spy("attn", ops.attn_bwd, 4))
    monkeypatch.setattr(ops, "gelu_bwd", spy("gelu", ops.gelu_bwd, 1))
    bk = backend("fp8")
    step(bk, 0)
    L, d, F = SHAPES.n_layer, SHAPES.d_model, SHAPES.d_ff
    N = 4 * SHAPES.seq_len
    assert [len(seen[k]) for k in ("ln", "res", "attn", "gelu")] == [1 + 2 * L, 2 * L, L, L]
    ar, p, hist = bk._acts, bk.p, bk.fp8.history
    assert hist.next == 1
    for k in range(L):  # the backward runs the layers in reverse
        i, h = L - 1 - k, f"h.{L - 1 - k}."
        want = {
            "x": ar.view("ln2", (N, d), i),
            "h": ar.view("act", (N, F), i),
            "dy": seen["ln"][0] if k == 0 else seen["res"][2 * k - 1],
            "dh": seen["gelu"][k],
            "w1": p[h + "mlp.W_1"],
            "w2": p[h + "mlp.W_2"],
            "ln1": ar.view("ln1", (N, d), i),
            "att": ar.view("att", (N, d), i),
            "dproj": seen["res"][2 * k],
            "dqkv": seen["attn"][k],
            "wqkv": np.stack([p[h + "attn.W_Q"], p[h + "attn.W_K"], p[h + "attn.W_V"]]),
            "wo": p[h + "attn.W_O"],
        }
        assert tuple(want) == DELAYED
        for t, x in want.items():
            got = hist.amax[hist.row(i, t)]
            assert got[0] > 0 and got[0] == np.float32(np.abs(x).max()), (i, t)
            assert not got[1:].any()


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
    with pytest.raises(ValueError, match=f"expected {2 * len(DELAYED)} tensors x {HISTORY} "
                                         f"passes, got {3 * len(DELAYED)} x {HISTORY}"):
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
def test_a_checkpoint_whose_history_names_fewer_tensors_resumes_and_the_log_says_so(
        tmp_path: Path, prepared_data: Path) -> None:
    """Checkpoints written while fewer GEMMs ran in FP8: one whose state.json's history holds
    the MLP's six tensors only (x, h, dy, dh, w1, w2), one (the weights also scaled by their own
    amax each pass) x, h, dy and dh only. Each resume goes on from the rows it has, the others
    starting empty (filled from the resumed passes on), and engine.log names those."""
    from engine.run.checkpoint import state_digest

    cfg = fp8_config(tmp_path)
    ran = tmp_path / "ran"
    r = run_engine(cfg, ran, "--backend", "numpy", "--max-steps", "10")
    assert r.returncode == 0, r.stdout + r.stderr
    ckpt = Path("checkpoints") / "step_00000010" / "state.json"
    doc = json.loads((ran / ckpt).read_text())
    full = AmaxHistory.from_json(doc[rec.STATE_FP8_HISTORY], 2).history
    assert full.next == 20 % HISTORY and (full.amax > 0).all()  # 20 passes: every slot written
    resumed = [(full.next + k) % HISTORY for k in range(8)]  # the 8 passes of steps 11..14
    kept = [k for k in range(HISTORY) if k not in resumed]
    for stored in (("x", "h", "dy", "dh", "w1", "w2"), ("x", "h", "dy", "dh")):
        missing = [t for t in DELAYED if t not in stored]
        run = tmp_path / f"{len(stored)} tensors"
        shutil.copytree(ran, run)
        old = full.amax.reshape(2, len(DELAYED), HISTORY)[:, [DELAYED.index(t) for t in stored]]
        doc[rec.STATE_FP8_HISTORY] = {"tensors": list(stored), "length": HISTORY,
                                      "next": full.next,
                                      "amax_bits": [int(b) for b in old.view(np.uint32).ravel()]}
        doc["state_sha256"] = state_digest(doc)
        (run / ckpt).write_text(json.dumps(doc, indent=1))
        r = run_engine(cfg, run, "--resume", "--backend", "numpy", "--max-steps", "14")
        assert r.returncode == 0, r.stdout + r.stderr
        log = (run / "engine.log").read_text()
        assert (f"resume: the checkpoint's FP8 amax history has no rows for {', '.join(missing)} "
                "(written by an engine that ran fewer GEMMs in FP8 or scaled the weights by "
                "their own amax each pass): each is scaled by its own amax until it has one, so "
                "these steps' bits differ from the run's had it gone on") in log, log[-3000:]
        assert "FP8 amax history starts afresh" not in log
        assert loss_records(run)[-1].step == 14
        last = json.loads((run / "checkpoints" / "step_00000014" / "state.json").read_text())
        got, without = AmaxHistory.from_json(last[rec.STATE_FP8_HISTORY], 2)
        assert without == () and got.next == 28 % HISTORY
        for layer in range(2):
            for tensor in DELAYED:
                row = got.amax[got.row(layer, tensor)]
                assert (row[resumed] > 0).all()
                if tensor in stored:  # the checkpoint's rows, in place where no resumed pass wrote
                    assert np.array_equal(row[kept], old[layer, stored.index(tensor), kept])
                else:  # no history but the resumed passes'
                    assert not row[kept].any()


def test_an_mlp_narrower_than_the_model_runs_in_fp8() -> None:
    """d_ff below d_model: the FP8 copies' buffers hold the [N, d] tensors, dqkv [3, N, d] and
    W_Q, W_K, W_V [3, d, d] too."""
    shapes = ModelShapes(n_layer=1, d_model=64, n_head=2, d_ff=32, vocab_size=300, seq_len=32)
    bk = NumpyBackend(shapes, 4, "fp8")
    bk.load_params(init_params(shapes, seed=2))
    bk.zero_grads()
    x, y = tokens(0)
    assert np.isfinite(bk.forward_backward(x, y)).all() and np.isfinite(bk.read_grads()).all()
