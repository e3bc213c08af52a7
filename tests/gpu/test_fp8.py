"""train/precision "fp8" (engine/backends/cuda/fp8.py): the FP8 copies and GEMMs against fp32,
a whole step against the bf16 step, determinism, bit-exact resume, and checkpoints that move
between fp8 and bf16."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import numpy as np
import pytest
from cudabk import cuda_backend
from devarrays import DevArrays, rounded

from engine import records as rec
from engine.model.fp8 import (
    DELAYED,
    E4M3,
    E5M2,
    FP8_GEMMS,
    HISTORY,
    AmaxHistory,
    round_fp8,
    scale_for,
)
from engine.model.layout import ModelShapes, init_params
from tests.conftest import loss_records, micro_config_dict, run_engine, start_engine, wait_for_step

pytestmark = pytest.mark.gpu

SHAPES = ModelShapes(n_layer=2, d_model=128, n_head=2, d_ff=512, vocab_size=8449, seq_len=64)
HP = {"loss_scale": 1.0, "grad_mult": 1.0, "lr": 1e-3, "beta1": 0.9, "beta2": 0.95,
      "eps": 1e-8, "weight_decay": 0.1, "max_norm": 1.0}


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture
def lt(gpu):
    """Ops on an LtGemm (the fused path's GEMMs), bf16 activations."""
    from engine.backends.cuda.cublas import WORKSPACE_BYTES
    from engine.backends.cuda.gemm import LtGemm
    from engine.backends.cuda.ops import Ops

    dev = DevArrays(gpu.drv, "bf16")
    gemm = LtGemm(WORKSPACE_BYTES, "test")
    ws = dev.empty((WORKSPACE_BYTES // 4,), "f32")
    o = Ops(gpu.kernels("bf16"), None, gpu.stream, "bf16", gemm=gemm, ws=ws)
    yield o, dev, gpu
    gpu.stream.synchronize()
    gemm.close()
    dev.free()


def decode_fp8(q: np.ndarray, e5m2: int) -> np.ndarray:
    """FP8 bytes (OCP E4M3 or E5M2) as float64, written out from the formats' definitions."""
    q = q.astype(np.int64)
    mbits, bias = (2, 15) if e5m2 else (3, 7)
    sign = np.where(q & 0x80, -1.0, 1.0)
    exp = (q >> mbits) & (0x7F >> mbits)
    man = q & ((1 << mbits) - 1)
    normal = (1.0 + man / 2.0**mbits) * 2.0 ** (exp - bias)
    sub = man / 2.0**mbits * 2.0 ** (1 - bias)
    return sign * np.where(exp == 0, sub, normal)


def amax_pass(o, dev, word: int, x_dev: int, n: int) -> None:
    """k_fp8_amax_delayed over a tensor with no history: its amax into `word`."""
    o._go("k_fp8_amax_delayed", 64, word, x_dev, n, dev.put(np.zeros(HISTORY), "f32"), HISTORY)


def fp8_copy(o, dev, x_dev: int, rows: int, cols: int, fmt: int,
             kernel: str = "k_fp8_cast_t", hist: np.ndarray | None = None
             ) -> tuple[int, int, int, int]:
    """(q [rows, cols], qt [cols, rows], inv, amax word) of a bf16 device matrix, by the
    engine's kernels (k_fp8_cast_t: 32 x 32 tiles of bytes; k_fp8_cast_t64: 64 x 64 tiles,
    16-byte accesses): scaled by its own amax (the amax pass first), or, given `hist`, by that
    history's largest (the cast then takes the amax as it goes)."""
    amax = dev.put(np.zeros(1), "i32")
    inv = dev.empty((1,), "f32")
    q, qt = (dev.empty((rows * cols // 4 + 4,), "f32") for _ in range(2))  # bytes
    if hist is None or not hist.any():
        amax_pass(o, dev, amax, x_dev, rows * cols)
    tile = 64 if kernel.endswith("64") else 32
    grid = (-(-cols // tile), -(-rows // tile))
    h = dev.put(hist.astype(np.float32), "f32") if hist is not None else 0
    o._go(kernel, grid, q, qt, inv, x_dev, amax, h, HISTORY, rows, cols, fmt)
    return q, qt, inv, amax


def host_bytes(gpu, ptr: int, n: int) -> np.ndarray:
    gpu.stream.synchronize()
    h = np.empty(n, np.uint8)
    gpu.drv.memcpy_dtoh(h, ptr)
    return h


def test_fp8_copies_and_gemms_against_fp32(lt, rng) -> None:
    """The cast kernels: q·(1/s) within FP8's rounding of x (E4M3 2^-4, E5M2 2^-3 relative),
    qt exactly q transposed, the scale from the tensor's amax; each FP8 GEMM layout the MLP
    uses (E4M3·E4M3 → bf16 with fast accumulation, E5M2·E4M3 → bf16, E4M3·E5M2 → fp32)
    against the fp32 product of the unquantized operands (bounds 5e-2 and 1e-1, relative
    Frobenius; the probe measured 3.75e-2 for E4M3)."""
    from engine.backends.cuda.cublas import R_32F
    from engine.backends.cuda.gemm import R_8F_E4M3, R_8F_E5M2

    o, dev, gpu = lt
    M, N, K = 256, 384, 512
    a = rounded(rng.normal(0, 1.0, (M, K)), "bf16")
    b = rounded(rng.normal(0, 0.05, (N, K)), "bf16")  # stored [N, K]: the TN layout
    want = a.astype(np.float64) @ b.astype(np.float64).T
    a_dev, b_dev = dev.put(a), dev.put(b)
    for fmt, tol in ((0, 2.0**-4), (1, 2.0**-3)):
        q, qt, inv, _ = fp8_copy(o, dev, a_dev, M, K, fmt)
        gpu.stream.synchronize()
        qb = np.empty(M * K, np.uint8)
        qtb = np.empty(M * K, np.uint8)
        gpu.drv.memcpy_dtoh(qb, q)
        gpu.drv.memcpy_dtoh(qtb, qt)
        assert np.array_equal(qb.reshape(M, K).T, qtb.reshape(K, M)), "qt is not q transposed"
        s = 1.0 / float(dev.get(inv)[0])
        assert abs(s - (57344.0 if fmt else 448.0) / np.abs(a).max()) <= 1e-6 * s
        back = decode_fp8(qb.reshape(M, K), fmt) / s
        big = np.abs(a) * s >= 2.0 ** (-6 if fmt == 0 else -14)  # normal FP8 numbers
        assert np.all(np.abs(back - a)[big] <= tol * np.abs(a)[big])
        # the 64 x 64 vector kernel: the same bytes
        q64, qt64, _, _ = fp8_copy(o, dev, a_dev, M, K, fmt, "k_fp8_cast_t64")
        assert np.array_equal(host_bytes(gpu, q64, M * K), qb)
        assert np.array_equal(host_bytes(gpu, qt64, M * K), qtb)
        # the weights' kernels (float32 masters), as _cast_weight runs them: the delayed amax
        # pass, then the cast reading the weight's history. With an empty history (a first
        # pass) the amax pass takes the amax; with one it does nothing and the cast takes it
        # as it goes. 64 x 64 tiles and 32 x 32 tiles agree, and give the bytes of the bf16
        # kernels' copy with the same history (bf16-exact values)
        w = dev.put(a, "f32")
        past = np.zeros(HISTORY, np.float32)
        past[4] = np.float32(np.abs(a).max()) * np.float32(0.5)  # some values saturate
        for h in (np.zeros(HISTORY, np.float32), past):
            h_dev = dev.put(h, "f32")
            got = []
            for name, tile in (("k_fp8_cast_t_f32", 32), ("k_fp8_cast_t64_f32", 64)):
                wamax = dev.put(np.zeros(1), "i32")
                o._go("k_fp8_amax_f32_delayed", 64, wamax, w, M * K, h_dev, HISTORY)
                if h.any():
                    assert int(dev.get(wamax)[0]) == 0, "the amax pass ran with a history"
                wq, wqt = (dev.empty((M * K // 4 + 4,), "f32") for _ in range(2))
                o._go(name, (K // tile, M // tile), wq, wqt, dev.empty((1,), "f32"), w, wamax,
                      h_dev, HISTORY, M, K, K, fmt)
                got.append((host_bytes(gpu, wq, M * K), host_bytes(gpu, wqt, M * K),
                            int(dev.get(wamax)[0])))
                # W_QKV's rows layout: the same bytes as column block 1 of rows 3K wide, the
                # other blocks untouched
                wide = dev.put(np.full(M * 3 * K // 4, -1, np.int64), "i32")
                o._go(name, (K // tile, M // tile), wide + K, wqt, dev.empty((1,), "f32"), w,
                      wamax, h_dev, HISTORY, M, K, 3 * K, fmt)
                rows3 = host_bytes(gpu, wide, M * 3 * K).reshape(M, 3, K)
                assert np.array_equal(rows3[:, 1], got[-1][0].reshape(M, K)), name
                assert (rows3[:, 0] == 255).all() and (rows3[:, 2] == 255).all(), name
            assert all(np.array_equal(x, y) for x, y in zip(*got, strict=True))
            taken = np.array([got[0][2]], np.uint32).view(np.float32)[0]
            assert taken == np.float32(np.abs(a).max())  # for the history, either way
            want_q = qb if not h.any() else host_bytes(
                gpu, fp8_copy(o, dev, a_dev, M, K, fmt, hist=h)[0], M * K)
            assert np.array_equal(got[0][0], want_q)
    layouts = [((R_8F_E4M3, R_8F_E4M3), 0, 0, "bf16", True, 5e-2),
               ((R_8F_E5M2, R_8F_E4M3), 1, 0, "bf16", False, 1e-1),
               ((R_8F_E4M3, R_8F_E5M2), 0, 1, "fp32", False, 1e-1)]
    for (ta, tb), fa, fb, out_kind, fast, bound in layouts:
        qa, _, ia, _ = fp8_copy(o, dev, a_dev, M, K, fa)
        qb_, _, ib, _ = fp8_copy(o, dev, b_dev, N, K, fb)
        out = dev.empty((M, N), "f32" if out_kind == "fp32" else "act")
        o._mm(out, qa, qb_, M, N, K, tb=True, scales=(ia, ib), fast_accum=fast,
              types=(ta, tb, R_32F if out_kind == "fp32" else o.act))
        got = dev.get(out)
        err = rel(got, want)
        print(f"FP8 GEMM types {ta},{tb} -> {out_kind}: relative error {err:.3e} (<= {bound})")
        assert np.all(np.isfinite(got)) and err <= bound


def fp8_gemms_of(bk) -> list[str]:
    """The GEMMs that run in FP8 where cuBLASLt takes every one: all but the QKV map's where
    Q, K, V are in slabs (classic attention)."""
    return [g for g in FP8_GEMMS if bk.build.qkv_rows or not g.startswith("qkv")]


def backend(precision: str, **kw):
    bk = cuda_backend(SHAPES, 4, precision, **kw)
    # one micro-batch of the fused step: the layers' weight gradients in bf16 in either
    # precision, the FP8 weight-gradient GEMMs writing theirs so too (gpu.grads_low_precision)
    assert bk.grads_lp
    bk.load_params(init_params(SHAPES, seed=5))
    return bk


def test_fp8_step_against_the_bf16_step(rng) -> None:
    """The same weights and tokens: the loss within 1% of the bf16 step's, the gradient's
    direction within a cosine of 0.99 and its norm within 10%; every linear map's GEMMs in FP8
    on this GPU, said by the backend."""
    tok = rng.integers(0, 8449, (4, 65)).astype(np.int32)
    out = {}
    for precision in ("bf16", "fp8"):
        bk = backend(precision)
        bk.zero_grads()
        rows = bk.forward_backward(tok[:, :-1], tok[:, 1:])
        out[precision] = (float(np.mean(rows)), bk.read_grads().astype(np.float64))
        if precision == "fp8":
            assert bk.fp8_gemms == fp8_gemms_of(bk), bk.build.fp8_ops.notes
            assert "FP8" in bk.describe() and bk.memory_plan().get("fp8", 0) > 0
        bk.close()
    (l16, g16), (l8, g8) = out["bf16"], out["fp8"]
    cos = float(g8 @ g16 / (np.linalg.norm(g8) * np.linalg.norm(g16)))
    ratio = float(np.linalg.norm(g8) / np.linalg.norm(g16))
    print(f"fp8 vs bf16 step: loss {l8:.5f} vs {l16:.5f}; gradient cosine {cos:.5f}, "
          f"norm ratio {ratio:.4f}")
    assert abs(l8 - l16) <= 1e-2 * abs(l16)
    assert cos >= 0.99 and abs(ratio - 1) <= 0.1


def test_fp8_steps_are_deterministic(rng) -> None:
    tok = rng.integers(0, 8449, (3, 4, 65)).astype(np.int32)
    res = []
    for _ in range(2):
        bk = backend("fp8")
        rows = [bk.train_step(t[:, :-1], t[:, 1:], t=i + 1, **HP) for i, t in enumerate(tok)]
        res.append((rows, bk.read_params()))
        bk.close()
    for (ra, na, ca), (rb, nb, cb) in zip(res[0][0], res[1][0], strict=True):
        assert np.array_equal(ra, rb) and (na, ca) == (nb, cb)
    assert np.array_equal(res[0][1], res[1][1])


@pytest.mark.slow
def test_sigterm_resume_in_fp8_is_bit_exact(tmp_path: Path, prepared_data: Path) -> None:
    """As test_train_resume's bf16 case: SIGTERM at step k, --resume, and the straight run with
    the same GEMM plan give the same records and model.ckpt bytes."""
    n = 30
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({**micro_config_dict(max_steps=n, precision="fp8"),
                               "gpu": {"gemm_tune": True}}))
    run = tmp_path / "stopped"
    proc = start_engine(cfg, run, "--backend", "cuda")
    wait_for_step(run, 17, proc)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    state = json.loads((run / "state.json").read_text())
    assert state["status"] == "stopped"
    ck = Path(state["last_checkpoint"]["path"])
    ck_state = json.loads((ck / "state.json").read_text())
    assert ck_state[rec.STATE_FP8_GEMMS], "no FP8 GEMM recorded"
    hist, without = AmaxHistory.from_json(ck_state[rec.STATE_FP8_HISTORY], SHAPES.n_layer)
    assert without == ()  # this engine's history: the weights' rows too
    assert hist.next == ck_state["trainer"]["step"] % HISTORY and (hist.amax > 0).any()
    plan = (run / "gemm_plan.json").read_text()
    r = run_engine(cfg, run, "--resume", "--backend", "cuda")
    assert r.returncode == 0, r.stdout + r.stderr
    straight = tmp_path / "straight"
    straight.mkdir()
    (straight / "gemm_plan.json").write_text(plan)
    r = run_engine(cfg, straight, "--backend", "cuda")
    assert r.returncode == 0, r.stdout + r.stderr
    keys = ("step", "loss", "grad_norm", "clip_scale", "lr", "tokens")
    traj = [[json.dumps(getattr(x, k)) for k in keys] for x in loss_records(run)]
    assert traj == [[json.dumps(getattr(x, k)) for k in keys] for x in loss_records(straight)]
    name = f"checkpoints/step_{n:08d}/model.ckpt"
    assert (run / name).read_bytes() == (straight / name).read_bytes()
    ready = [json.loads(x) for x in (straight / "events.jsonl").read_text().splitlines()
             if '"ready"' in x][-1]
    # the GEMMs in FP8: those the start-up timing chose (the plan's), in both runs
    uses = {k.split(" R=")[0][4:]: v["use"] for k, v in json.loads(plan)["choices"].items()
            if k.startswith("fp8 ")}
    assert ready["precision"] == "fp8" and set(uses) == set(FP8_GEMMS)
    assert ready["fp8_gemms"] == [g for g in FP8_GEMMS if uses[g] == "fp8"]
    resumed = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()
               if '"ready"' in x][-1]
    assert resumed["fp8_gemms"] == ready["fp8_gemms"]


@pytest.mark.slow
@pytest.mark.parametrize("first, then", [("fp8", "bf16"), ("bf16", "fp8")])
def test_a_checkpoint_moves_between_fp8_and_bf16(first: str, then: str, tmp_path: Path,
                                                 prepared_data: Path) -> None:
    """The checkpoint holds fp32 masters and moments only: a run goes on in the other precision
    with --resume --precision, says so, and keeps learning (finite losses to the end)."""
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps(micro_config_dict(max_steps=20, precision=first)))
    run = tmp_path / "run"
    r = run_engine(cfg, run, "--backend", "cuda", "--max-steps", "10")
    assert r.returncode == 0, r.stdout + r.stderr
    r = run_engine(cfg, run, "--backend", "cuda", "--resume", "--precision", then,
                   "--max-steps", "20")
    assert r.returncode == 0, r.stdout + r.stderr
    log = (run / "engine.log").read_text()
    assert f"--precision {then} replaces the run's {first}" in log
    assert "NOT used" not in r.stderr
    recs = loss_records(run)
    assert [x.step for x in recs] == list(range(1, 21))
    assert all(np.isfinite(x.loss) for x in recs)
    ready = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()
             if '"ready"' in x][-1]
    assert ready["precision"] == then and bool(ready["fp8_gemms"]) == (then == "fp8")


def test_the_gelu_kernels_amax_is_the_amax_pass(lt, rng) -> None:
    """k_mlp_gelu_fwd / _bwd given an amax word: the same word as the amax pass over what they
    wrote (exact: a max), and the same outputs as without it."""
    o, dev, _ = lt
    n = 8 * 3072 + 5  # a scalar tail too
    pre = dev.put(rounded(rng.normal(0, 2.0, n), "bf16"))
    dact = rounded(rng.normal(0, 1e-3, n), "bf16")
    for bwd in (False, True):
        outs, words = [], []
        for fused in (False, True):
            out = dev.put(dact) if bwd else dev.empty((n,))
            word = dev.put(np.zeros(1), "i32")
            (o.gelu_bwd if bwd else o.gelu_fwd)(out, pre, n, amax=word if fused else 0)
            if not fused:
                amax_pass(o, dev, word, out, n)
            outs.append(dev.get(out))
            words.append(int(dev.get(word)[0]))
        assert np.array_equal(outs[0], outs[1])
        assert words[0] == words[1] != 0


@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("with_history", [False, True])
@pytest.mark.parametrize("bwd", [False, True])
def test_the_gelu_casts_give_the_bytes_of_the_gelu_kernel_then_the_cast(
        lt, rng, bwd: bool, with_history: bool, keep: bool) -> None:
    """k_fp8_gelu_cast_t64 (k_fp8_dgelu_cast_t64): GELU(pre) (dg·GELU'(pre)) computed by the
    kernel that casts it, against k_mlp_gelu_fwd (_bwd) and then k_fp8_cast_t64: the same FP8
    bytes, transposed bytes, inverse scale and amax word, and the same bf16 values where it
    keeps them (keep: the bf16 buffer given; else it is left as it was); scaled by a history,
    or, without one, by the amax its delayed pass computes."""
    o, dev, gpu = lt
    H = HISTORY
    rows, cols = 128, 192
    n = rows * cols
    pre_h = rounded(rng.normal(0, 2.0, (rows, cols)), "bf16")
    dg_h = rounded(rng.normal(0, 1e-3, (rows, cols)), "bf16")
    hist = np.zeros(H, np.float32)
    if with_history:
        hist[[2, 7]] = (1.5e-3, 2.5e-3) if bwd else (3.0, 4.5)
    fmt = 1 if bwd else 0
    pre = dev.put(pre_h)
    hist_dev = dev.put(hist, "f32")
    out = {}
    for fused in (False, True):
        word = dev.put(np.zeros(1), "i32")
        inv = dev.empty((1,), "f32")
        q, qt = (dev.empty((n // 4 + 4,), "f32") for _ in range(2))  # bytes
        val = dev.put(dg_h) if bwd else dev.empty((rows, cols))
        if fused:
            grid = (cols // 64, rows // 64)
            kept = val if keep else 0
            if bwd:
                o._go("k_fp8_dgelu_amax_delayed", 64, word, val, pre, n, hist_dev, H)
                o._go("k_fp8_dgelu_cast_t64", grid, q, qt, inv, kept, val, pre, word, hist_dev,
                      H, rows, cols)
            else:
                o._go("k_fp8_gelu_amax_delayed", 64, word, pre, n, hist_dev, H)
                o._go("k_fp8_gelu_cast_t64", grid, q, qt, inv, kept, pre, word, hist_dev, H,
                      rows, cols)
        else:
            (o.gelu_bwd if bwd else o.gelu_fwd)(val, pre, n, amax=word)
            o._go("k_fp8_cast_t64", (cols // 64, rows // 64), q, qt, inv, val, word, hist_dev,
                  H, rows, cols, fmt)
        out[fused] = (host_bytes(gpu, q, n), host_bytes(gpu, qt, n), dev.get(inv)[0],
                      int(dev.get(word)[0]), dev.get(val))
    for k, what in enumerate(("q", "qt", "inverse scale", "amax word", "kept bf16 values")):
        a, b = out[False][k], out[True][k]
        if k == 4 and not keep:  # the buffer as it was: dg (bwd), or never written
            if bwd:
                assert np.array_equal(b, dg_h.astype(b.dtype)), "dg was overwritten"
            continue
        same = np.array_equal(a, b)
        assert same, f"{what}: {np.sum(np.asarray(a) != np.asarray(b))} differ"
    assert out[True][3] != 0


def test_a_shorter_pass_keeps_fp8_at_full_length(rng) -> None:
    """A pass of 37 positions (148 rows: the weight gradients' K = rows is not a multiple of 16
    bytes, which cuBLASLt's FP8 may refuse) runs, close to bf16, and the full-length pass after
    it still runs every GEMM in FP8."""
    tok = rng.integers(0, 8449, (4, 65)).astype(np.int32)
    short = tok[:, :38]
    out = {}
    for precision in ("bf16", "fp8"):
        bk = backend(precision)
        bk.zero_grads()
        bk.forward_backward(short[:, :-1], short[:, 1:])
        out[precision] = bk.read_grads().astype(np.float64)
        bk.zero_grads()
        bk.forward_backward(tok[:, :-1], tok[:, 1:])
        if precision == "fp8":
            assert bk.fp8_gemms == fp8_gemms_of(bk), bk.build.fp8_ops.notes
        bk.close()
    g16, g8 = out["bf16"], out["fp8"]
    assert np.all(np.isfinite(g8))
    assert float(g8 @ g16 / (np.linalg.norm(g8) * np.linalg.norm(g16))) >= 0.99


@pytest.mark.parametrize("kernel", ["k_fp8_cast_t", "k_fp8_cast_t64"])
@pytest.mark.parametrize("fmt", [0, 1], ids=["E4M3", "E5M2"])
def test_the_cast_gives_the_numpy_twins_fp8_values(lt, rng, fmt: int, kernel: str) -> None:
    """engine.model.fp8's recipe, bit for bit: scaled by the history's largest amax where there
    is one (the cast taking the tensor's amax as it goes), else by the tensor's own; the FP8
    value of each x·s as round_fp8 gives it, and 1/s as cuBLASLt's inverse scale."""
    o, dev, gpu = lt
    M, K = 128, 192
    x = rng.normal(0, 3.0, (M, K))
    x[0, :3] = [1e-9, -7e-7, 0.0]  # subnormal and zero FP8 values
    x = rounded(x, "bf16").astype(np.float32)  # the device's values exactly
    x_dev = dev.put(x)
    form = E5M2 if fmt else E4M3
    amax_now = np.float32(np.abs(x).max())
    hist = np.zeros(HISTORY, np.float32)
    hist[[3, 11]] = [amax_now * np.float32(0.5), amax_now * np.float32(0.75)]  # some saturate
    # no history given (scaled by the amax word as the amax pass left it), an empty one (a
    # tensor's first pass), a history
    for h in (None, np.zeros(HISTORY, np.float32), hist):
        q, _, inv, word = fp8_copy(o, dev, x_dev, M, K, fmt, kernel, hist=h)
        s = scale_for(amax_now if h is None or not h.any() else np.float32(h.max()), form)
        got = decode_fp8(host_bytes(gpu, q, M * K).reshape(M, K), fmt)
        assert np.array_equal(got, round_fp8(x * s, form).astype(np.float64))
        assert dev.get(inv)[0] == np.float32(1.0) / s
        taken = np.array([int(dev.get(word)[0])], np.uint32).view(np.float32)[0]
        assert taken == amax_now  # by the amax pass, or by the cast as it goes


def test_the_record_kernel_is_the_historys_record(lt) -> None:
    """k_fp8_record: each delayed tensor's amax word (in the engine's twelve-a-layer layout,
    the history's row order) into the history's next slot, 0 where not finite, and the slot
    moves on, wrapping at HISTORY."""
    o, dev, _ = lt
    L, n = 3, len(DELAYED)
    words = np.arange(1, L * n + 1, dtype=np.float32) * np.float32(0.25)
    words[n + 2] = np.inf  # layer 1's dy
    words[2 * n + 5] = np.nan  # layer 2's W2
    host = AmaxHistory.empty(L)
    host.next = HISTORY - 1
    hist_dev = dev.put(host.amax.ravel(), "f32")
    next_dev = dev.put(np.array([host.next]), "i32")
    word_dev = dev.put(words.view(np.uint32).astype(np.int64), "i32")
    for _ in range(2):
        o._go("k_fp8_record", 1, hist_dev, next_dev, word_dev, L * n, n, n, HISTORY)
        now = np.array([words[layer * n + t] for layer in range(L) for t in range(n)],
                       np.float32)
        host.record(now)
    assert np.array_equal(dev.get(hist_dev).reshape(host.amax.shape), host.amax)
    assert int(dev.get(next_dev)[0]) == host.next == 1


def test_the_history_fills_each_pass_and_a_resume_needs_it(rng) -> None:
    """Three fp8 steps: the history's next slot is 3 and its first three slots hold amaxes;
    weights, moments and history read back into a fresh backend give the next two steps' bits
    exactly; the same without the history scale otherwise (other losses)."""
    tok = rng.integers(0, 8449, (5, 4, 65)).astype(np.int32)
    a = backend("fp8")
    for i in range(3):
        a.train_step(tok[i, :, :-1], tok[i, :, 1:], t=i + 1, **HP)
    hist = a.fp8_history()
    assert hist is not None and hist.next == 3
    on = [hist.row(layer, t) for layer in range(SHAPES.n_layer) for t in DELAYED
          if a.build.qkv_rows or t not in ("ln1", "dqkv", "wqkv")]
    assert (hist.amax[on, :3] > 0).all() and not hist.amax[:, 3:].any()
    saved = (a.read_params(), *a.read_optimizer(), hist)
    straight = [a.train_step(tok[i, :, :-1], tok[i, :, 1:], t=i + 1, **HP) for i in (3, 4)]
    a.close()
    runs = []
    for with_history in (True, False):
        b = backend("fp8")
        b.load_params(saved[0])
        b.load_optimizer(saved[1], saved[2])
        b.load_fp8_history(saved[3] if with_history else None)
        runs.append([b.train_step(tok[i, :, :-1], tok[i, :, 1:], t=i + 1, **HP) for i in (3, 4)])
        b.close()
    for (ra, na, ca), (rb, nb, cb) in zip(straight, runs[0], strict=True):
        assert np.array_equal(ra, rb) and (na, ca) == (nb, cb)
    assert not np.array_equal(straight[0][0], runs[1][0][0])


def test_with_gemm_tune_each_gemm_is_timed_and_the_start_says_whether_fp8_pays() -> None:
    """gpu.gemm_tune at the 312M model's widths (2 layers): every FP8 GEMM timed in FP8 and in
    bf16, the faster kept in the GEMM plan (and in fp8_gemms); the notes say a layer's linear
    maps on both paths and, where FP8 is the slower, that it does not pay. A backend given that
    plan runs the same choices without timing them."""
    import re

    from engine.backends.cuda.fp8 import MIN_CHOICE_MS

    s = ModelShapes(n_layer=2, d_model=1024, n_head=16, d_ff=4096, vocab_size=8449,
                    seq_len=1024)
    bk = cuda_backend(s, 8, "fp8", gemm_tune=True)
    key = bk.build.fp8_ops.choice_key
    plan = bk.gemm.export_plan()
    chosen = {g: plan["choices"][key(g)] for g in fp8_gemms_of(bk)}
    # a GEMM under MIN_CHOICE_MS in bf16 (at d 1024 the output projection's) stays in FP8
    assert all(c["use"] in ("fp8", "bf16") and (c["use"] == "fp8" or c["bf16_ms"] >= MIN_CHOICE_MS)
               for c in chosen.values()), chosen
    assert any(c["bf16_ms"] >= MIN_CHOICE_MS for c in chosen.values()), chosen
    assert bk.fp8_gemms == [g for g in chosen if chosen[g]["use"] == "fp8"]
    [note] = [n for n in bk.notes if n.startswith("FP8 at d 1024")]
    t8, t16 = map(float, re.findall(r"([\d.]+) ms", note)[:2])
    assert t8 == t16 or ("does not pay" in note) == (t8 > t16), note
    assert "each path a CUDA graph, as the step runs it" in note, note
    bk.close()
    again = cuda_backend(s, 8, "fp8", gemm_tune=True, gemm_plan=plan)
    assert again.fp8_gemms == [g for g in chosen if chosen[g]["use"] == "fp8"]
    assert key("fc1 fwd") not in again.gemm.choice_ms  # taken from the plan, not timed
    again.close()


def test_gemms_too_short_to_time_stay_in_fp8_and_the_start_says_so() -> None:
    bk = backend("fp8", gemm_tune=True)
    assert bk.fp8_gemms == fp8_gemms_of(bk)
    assert any(n.startswith("FP8 at d 128") and "too short" in n for n in bk.notes), bk.notes
    bk.close()


def test_one_pass_records_the_amaxes_the_numpy_twin_records(rng) -> None:
    """The same weights and tokens, one training pass each: the CUDA history's first slot
    against NumpyBackend's (fp8), row for row (layer, then DELAYED's tensors), within the
    distance of bf16 activations from float32 ones; the weights' rows exactly (the amax of the
    same fp32 masters). With Q, K, V in slabs the QKV map runs in bf16: its rows stay 0."""
    from engine.backends.numpy import NumpyBackend

    tok = rng.integers(0, 8449, (4, 65)).astype(np.int32)
    gpu = backend("fp8")
    ref = NumpyBackend(SHAPES, 4, "fp8")
    ref.load_params(init_params(SHAPES, seed=5))
    for bk in (gpu, ref):
        bk.zero_grads()
        bk.forward_backward(tok[:, :-1], tok[:, 1:])
    got, want = gpu.fp8_history(), ref.fp8_history()
    qkv = gpu.build.qkv_rows
    gpu.close()
    assert got.next == want.next == 1
    off = [] if qkv else [want.row(layer, t) for layer in range(SHAPES.n_layer)
                          for t in ("ln1", "dqkv", "wqkv")]
    on = [r for r in range(len(want.amax)) if r not in off]
    assert not got.amax[off].any()
    a, b = got.amax[on, 0].astype(np.float64), want.amax[on, 0].astype(np.float64)
    assert np.all(b > 0) and np.all(np.abs(a - b) <= 0.05 * b), np.c_[a, b]
    weights = [want.row(layer, t) for layer in range(SHAPES.n_layer)
               for t in ("w1", "w2", "wo", *(("wqkv",) if qkv else ()))]
    assert np.array_equal(got.amax[weights, 0], want.amax[weights, 0])


def test_a_weights_scale_comes_from_its_history_as_in_the_numpy_twin(rng) -> None:
    """The weights are delayed tensors: layer 1's W1 grown 3x between two passes, the second
    pass still scales it by the first pass's amax (the inverse scale cuBLASLt reads: bit for
    bit the numpy twin's) and records its amax now, exactly as the numpy twin does."""
    from engine.backends.numpy import NumpyBackend
    from engine.backends.numpy.fp8 import SCALES

    tok = rng.integers(0, 8449, (4, 65)).astype(np.int32)
    gpu = backend("fp8")
    ref = NumpyBackend(SHAPES, 4, "fp8")
    ref.load_params(init_params(SHAPES, seed=5))
    fp8 = gpu.build.fp8_ops

    def pass_() -> None:
        for bk in (gpu, ref):
            bk.zero_grads()
            bk.forward_backward(tok[:, :-1], tok[:, 1:])

    def inverse_scale(layer: int, name: str) -> np.float32:
        gpu.synchronize()
        out = np.empty(1, np.float32)
        fp8.drv.memcpy_dtoh(out, fp8._scale(layer, name)[1])
        return out[0]

    pass_()
    first = ref.fp8_history().amax[ref.fp8.history.row(1, "w1"), 0]
    ref.p["h.1.mlp.W_1"] *= np.float32(3.0)
    gpu.load_params(np.array(ref.read_params()))
    pass_()
    got, want = gpu.fp8_history(), ref.fp8_history()
    row = want.row(1, "w1")
    assert got.next == want.next == 2
    assert want.amax[row, 1] == np.float32(3.0) * first  # recorded: its amax now
    assert np.array_equal(got.amax[row, :2], want.amax[row, :2])
    for layer in range(SHAPES.n_layer):
        for name in ("w1", "w2", "wo", *(("wqkv",) if gpu.build.qkv_rows else ())):
            s = ref.fp8.scales[layer, SCALES.index(name)]
            assert inverse_scale(layer, name) == np.float32(1.0) / s, (layer, name)
    # pass 2 scaled layer 1's W1 by pass 1's amax, not by its amax now
    assert ref.fp8.scales[1, SCALES.index("w1")] == scale_for(first, E4M3)
    gpu.close()


def test_each_accumulated_pass_records_its_amaxes(rng) -> None:
    """Gradient accumulation (forward_backward twice, the host-driven passes and their
    graphs): two records, the second pass's in slot 1."""
    tok = rng.integers(0, 8449, (2, 4, 65)).astype(np.int32)
    bk = backend("fp8")
    bk.zero_grads()
    for t in tok:
        bk.forward_backward(t[:, :-1], t[:, 1:])
    h = bk.fp8_history()
    on = [h.row(layer, t) for layer in range(SHAPES.n_layer) for t in DELAYED
          if bk.build.qkv_rows or t not in ("ln1", "dqkv", "wqkv")]
    bk.close()
    assert h.next == 2 and (h.amax[on, :2] > 0).all() and not h.amax[:, 2:].any()
