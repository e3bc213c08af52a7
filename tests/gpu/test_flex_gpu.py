"""The flex attention backward on the GPU (gpu.flex_backward, engine/backends/cuda/flex_attn.py):
the flex deterministic attention backward against cuDNN's deterministic backward and numpy on
the same inputs, eager and replayed from a captured CUDA graph; a training step against the
numpy backend; two runs the same bits; SIGTERM + --resume bit-exact with the run's config.

Skipped, with the reason, without cuDNN's frontend, off sm_90, or without a flex library:
ANDREA_FLEX_LIB (scripts/flex-pack builds and packs one where its packages are; `FLEX=1
scripts/gpu-check` unpacks it on the GPU machine and sets it), else a build, which needs
ANDREA_FLEX_PYTHON's packages and g++ (flex_attn.library_paths).

The first flex call of the session runs in a subprocess with a timeout (first_call_ends): a
kernel that never ends fails every test here after FIRST_CALL_S instead of hanging the file
(pytest-timeout is not installed; gpu-check's TEST_TIMEOUT bounds the file as a whole)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from devarrays import DevArrays, check_close, rounded
from test_backend import STEP_BOUND, batch, make
from test_train_resume import CUDA, N, assert_same_as_straight, checkpoint_gpu, stop_at_k, train

from engine.backends.cuda.flex_call import scratch_bytes
from engine.backends.numpy import NumpyBackend
from engine.backends.numpy import ops as npo
from engine.model.layout import ModelShapes, init_params, tensor_table
from tests.conftest import micro_config_dict

pytestmark = pytest.mark.gpu

FLEX = "flex deterministic backward"


@pytest.fixture
def flex(gpu, monkeypatch):
    """The GPU, with a flex library found (else the test skips)."""
    from engine import env
    from engine.backends.cuda import flex_attn
    from engine.backends.cuda.cudnn_attn import cudnn_available
    from engine.errors import RunError

    ok, why = cudnn_available()
    if not ok:
        pytest.skip(why)
    if gpu.dev.compute_capability() != (9, 0):
        pytest.skip(f"the flex kernels are sm_90a's, this GPU is {gpu.arch}")
    try:
        lib = flex_attn.library_paths()
    except RunError as e:
        pytest.skip(f"no flex library: {e} (scripts/flex-pack, then FLEX=1 scripts/gpu-check)")
    monkeypatch.setenv(env.FLEX_LIB.name, str(lib[0]))  # built once: the backends load it
    why = first_call_ends()
    if why:
        pytest.fail(why)
    return gpu


FIRST_CALL_S = 180  # a start-up of a small backend, its first flex call included, takes seconds
_first_call: list[str] = []


def first_call_ends() -> str:
    """"" where a small CudaBackend with the flex backward starts in a subprocess within
    FIRST_CALL_S and runs the flex backward; else why not. Once per session (cached): pytest-
    timeout is not installed here, and a kernel that spins (dq_sem left nonzero) or faults
    would hang or kill this process's context, so no test here makes the first call in it.
    gpu-check's TEST_TIMEOUT still bounds the whole file."""
    if _first_call:
        return _first_call[0]
    root = Path(__file__).resolve().parents[2]
    code = ("from engine.backends.cuda import CudaBackend\n"
            "from engine.model.layout import ModelShapes\n"
            "m = ModelShapes(n_layer=1, d_model=128, n_head=2, d_ff=512, vocab_size=8449, "
            "seq_len=256)\n"
            "b = CudaBackend(m, 2, 'bf16')\n"
            # two steps: the first captures the step graph (the dq_sem memset as a node), the
            # second replays it, where a fill node that failed to zero dq_sem would spin
            "import numpy as np\n"
            "x = np.zeros((2, 256), np.int32)\n"
            "b.forward_backward(x, x)\nb.forward_backward(x, x)\nb.synchronize()\n"
            "print(b.describe())\nprint(*b.notes, sep='\\n')\nb.close()\n")
    try:
        r = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True,
                           text=True, timeout=FIRST_CALL_S)
        out = r.stdout + r.stderr
        why = ("" if r.returncode == 0 and FLEX in r.stdout else
               f"a backend with the flex backward (exit {r.returncode}) did not run it: "
               f"backward:\n{out[-3000:]}")
        print(f"first flex call, in a subprocess: {r.stdout.strip()}")
    except subprocess.TimeoutExpired:
        why = (f"a backend with the flex backward did not start within {FIRST_CALL_S} s in a "
               f"subprocess (its first flex call spinning? dq_sem left nonzero); the other flex "
               f"tests are not run in this process")
    _first_call.append(why)
    return why


def tm(a: np.ndarray) -> np.ndarray:
    return np.swapaxes(a, 0, 1)


# flex vs cuDNN's deterministic backward: both accumulate in fp32 and round once to bf16, in
# other orders, so an element differs by about an ulp of its own magnitude (measured on the
# H200 at B8/T1024/H12, randn inputs, dev/bench_attention.py: max |diff| dQ 1.95e-3, dK
# 7.8e-3, dV 3.9e-3, an ulp or less of those gradients' magnitudes). Per 128-row block (a
# kernel tile: one batch row, 128 positions, one head) the largest difference is bounded by
# BLOCK_ULPS ulps of the block's largest |cuDNN| value; one wrong tile is off by about its whole
# magnitude (2⁷ ulps). The relative norm: two roundings, ~2⁻⁸ of each element at worst; a wrong
# 128-row tile of 768 gives ~3.6e-2.
BLOCK_ULPS = 4
FLEX_VS_CUDNN = 1e-2


def bf16_ulp(m: np.ndarray) -> np.ndarray:
    """The bf16 spacing at magnitude m (8 significant bits); that of the smallest normal at 0."""
    m = np.maximum(np.abs(np.asarray(m, np.float64)), np.finfo(np.float32).tiny)
    return np.exp2(np.floor(np.log2(m)) - 7)


def block_ulps(got: np.ndarray, want: np.ndarray, H: int) -> tuple[float, float]:
    """(the largest over 128-row blocks of max |got − want| in bf16 ulps of the block's largest
    |want|, the largest |got − want|) for [B, T, H·64] gradients; a non-finite value: inf."""
    B, T, d = want.shape
    shape = (B, T // 128, 128, H, d // H)
    g, w = (np.asarray(a, np.float64).reshape(shape) for a in (got, want))
    if not np.all(np.isfinite(g)):
        return float("inf"), float("inf")
    diff = np.abs(g - w).max(axis=(2, 4))
    return float((diff / bf16_ulp(np.abs(w).max(axis=(2, 4)))).max()), float(diff.max())


@pytest.mark.parametrize(("B", "T", "H"), [(2, 256, 4), (1, 128, 2), (8, 1024, 12)])
def test_flex_backward_matches_cudnn_and_numpy_eager_and_replayed(flex, rng, B, T, H):
    """cuDNN's forward (rows), then its deterministic backward and the flex one (Ops.
    attn_bwd_cudnn with and without `flex`) on the same bf16 inputs: dQ, dK, dV within 2e-2 of
    numpy's float64 (the bound tests/gpu/test_cudnn.py gives cuDNN's), within FLEX_VS_CUDNN of
    cuDNN's and every 128-row block within BLOCK_ULPS bf16 ulps of cuDNN's; the flex
    call twice the same bits, the first over a dQ accumulator of NaNs (nothing zeroes it: each
    query block's first contribution stores, flex_build_main.first_dq_stores, so an element no
    contribution wrote would come out NaN); captured in a CUDA graph (dq_sem's memset a k_fill
    node), two replays the eager bits."""
    from engine.backends.cuda import flex_attn, graphs
    from engine.backends.cuda.cudnn_attn import CudnnAttention
    from engine.backends.cuda.memory import Plan
    from engine.backends.cuda.ops import Ops

    gpu, precision, hd = flex, "bf16", 64
    d, R = H * hd, B * T
    qkv = rounded(rng.normal(0, 1, (3, B, T, d)), precision)
    dout = rounded(rng.normal(0, 1, (B, T, d)), precision)
    probs, want = np.empty((B, H, T, T)), np.empty((B, T, d))
    npo.attn_fwd(qkv, H, probs, want)
    w_dqkv = np.empty((3, B, T, d))
    npo.attn_bwd(dout, qkv, probs, H, w_dqkv, np.empty((B, H, T, T)))

    ar = CudnnAttention(precision, H, hd, gpu.stream.handle, rows=True)
    ar.build(B, T, backward=True)
    dev = DevArrays(gpu.drv, precision)
    plan = Plan()
    flex_attn.plan_buffers(plan, B, T, H)
    try:
        plan.allocate(gpu.drv)
        fa = flex_attn.FlexAttention(flex_attn.open_backward(B, T, H, gpu.ordinal), ar.scale)
        fa.bind(plan, gpu.drv)
        cws = dev.empty((max(1, ar.workspace_bytes(B, T)) // 4 + 1,), "f32")
        o = Ops(gpu.kernels(precision), None, gpu.stream, precision, cudnn=ar, cudnn_ws=cws)
        rows = np.concatenate([tm(qkv[j]) for j in range(3)], axis=2)  # [T, B, 3d]
        qkvp, dop = dev.put(rows), dev.put(tm(dout))
        out, stats = dev.empty((T, B, d)), dev.empty((B, H, T), "f32")
        o.attn_fwd_cudnn(qkvp, out, stats, B, T, d, R * d)
        acc = plan["flex.dq_accum"]
        gpu.drv.memset_d32(acc, 0x7FC00000, scratch_bytes(B, T, H)["dq_accum"] // 4)
        gpu.drv.Context.synchronize()  # the memset runs on the legacy stream
        got = {}
        for name in ("cudnn", "flex", "flex again"):
            o.flex = None if name == "cudnn" else fa
            p = dev.empty((T, B, 3 * d))
            o.attn_bwd_cudnn(dop, qkvp, out, stats, p, B, T, d, R * d)
            got[name] = dev.get(p)
        assert np.array_equal(got["flex"], got["flex again"]), "flex: not the same bits twice"
        for j, name in enumerate("QKV"):
            f, c = (tm(got[k][:, :, j * d : (j + 1) * d]) for k in ("flex", "cudnn"))
            check_close(f, w_dqkv[j], 2e-2, f"flex attn_bwd d{name} vs numpy", precision)
            check_close(f, c, FLEX_VS_CUDNN, f"flex attn_bwd d{name} vs cuDNN's", precision)
            worst, diff = block_ulps(f, c, H)
            print(f"flex vs cuDNN B{B} T{T} H{H} d{name}: max |diff| {diff:.3g}, worst "
                  f"128-row block {worst:.2f} bf16 ulps of its largest |cuDNN| value")
            assert worst <= BLOCK_ULPS, (f"d{name}: a 128-row block {worst:.1f} bf16 ulps from "
                                         f"cuDNN's (bound {BLOCK_ULPS})")
        p = dev.empty((T, B, 3 * d))
        o.flex = fa
        fill = graphs.FillKernel.of(str(gpu.cubin(precision, "fill")))
        g = graphs.capture(gpu.stream.handle,
                           lambda: o.attn_bwd_cudnn(dop, qkvp, out, stats, p, B, T, d, R * d),
                           fill)
        try:
            assert g.fills or g.fill_note, "no dq_sem memset in the captured graph"
            for _ in range(2):
                g.launch()
                gpu.stream.synchronize()
                assert np.array_equal(dev.get(p), got["flex"]), "graph replay: other bits"
        finally:
            g.close()
    finally:
        gpu.stream.synchronize()
        ar.close()
        dev.free()
        plan.free()


M = ModelShapes(n_layer=2, d_model=256, n_head=4, d_ff=1024, vocab_size=8449, seq_len=256)


def _count_runs(gpu) -> list[int]:
    """FlexBackward.run on this backend counted from here on: [calls]. (Python's call happens
    eagerly or while a graph is captured, not when it is replayed.)"""
    fb, calls = gpu.build.flex.fb, [0]
    run = fb.run

    def counted(*a, **kw):
        calls[0] += 1
        return run(*a, **kw)

    fb.run = counted
    return calls


def test_a_step_with_flex_matches_numpy_and_says_so(flex, rng):
    """forward_backward with the flex backward (T 201 < seq_len: the full-length backward with
    dO zeroed past T) against numpy in float64, within the full-step bf16 bounds; the memory
    plan has its "flex" group; describe() names it; Ops runs it (ops.flex, FlexBackward.run
    once per layer in each step, each a graph's first use here, one argument set per layer);
    and a backend with gpu.flex_backward false (the same GEMM plan) gives other bits for every
    layer's W_Q, W_K, W_V gradient (another reduction order), within the bound of them."""
    params = init_params(M, seed=int(rng.integers(1 << 30)))
    ref = NumpyBackend(M, 4, dtype=np.float64)
    ref.load_params(params.astype(np.float64))
    gpu = make(M, 4, "bf16", attention="cudnn")
    cud = None
    try:
        cud = make(M, 4, "bf16", attention="cudnn", gemm_plan=gpu.gemm_plan,
                   flex_backward=False)
        assert gpu.build.flex is not None, gpu.notes
        assert gpu.build.ops.flex is gpu.build.flex, "the backend does not hand its flex backward to Ops"
        assert cud.build.flex is None and cud.build.ops.flex is None and FLEX not in cud.describe()
        assert FLEX in gpu.describe() and gpu.resolved["flex_backward"] is True
        assert gpu.memory_plan()["flex"] >= sum(scratch_bytes(4, M.seq_len, 4).values())
        calls = _count_runs(gpu)
        gpu.load_params(params)
        cud.load_params(params)
        bound = STEP_BOUND["bf16"]
        for T in (256, 201):
            x, y = batch(rng, M, 4, T)
            want = ref.forward_backward(x, y, loss_scale=3.0)
            ref_g = ref.read_grads().copy()
            ref.zero_grads()
            gpu.zero_grads()
            cud.zero_grads()
            before = calls[0]
            got = gpu.forward_backward(x, y, loss_scale=3.0)
            assert calls[0] - before == M.n_layer, f"T={T}: flex ran {calls[0] - before} times"
            assert len(gpu.build.flex._args) == M.n_layer  # one argument set per layer's buffers
            cud.forward_backward(x, y, loss_scale=3.0)
            check_close(got, want, bound["loss"], f"flex step T={T}: row losses", "bf16")
            g, gc = gpu.read_grads(), cud.read_grads()
            same = []
            for t in tensor_table(M):
                sl = slice(t.offset, t.offset + t.size)
                check_close(g[sl], ref_g[sl], bound["grad"], f"flex step T={T}: {t.name}",
                            "bf16")
                if np.array_equal(g[sl].view(np.uint32), gc[sl].view(np.uint32)):
                    same.append(t.name)
                if ".attn.W_" in t.name and not t.name.endswith("W_O"):
                    assert t.name not in same, f"T={T}: {t.name} the same bits as cuDNN's"
                    check_close(g[sl], gc[sl], bound["grad"],
                                f"flex step T={T}: {t.name} vs cuDNN's", "bf16")
            print(f"flex step T={T}: the same bits as cuDNN's backward in {same}")
    finally:
        gpu.close()
        if cud is not None:
            cud.close()


def _train(gpu, steps: int) -> np.ndarray:
    rng = np.random.default_rng(2)
    losses = []
    for t in range(1, steps + 1):
        x, y = batch(rng, M, 4, 256 if t % 2 else 199)
        r = gpu.train_step(x, y, loss_scale=1.0, grad_mult=1.0, lr=1e-3, beta1=0.9, beta2=0.95,
                           eps=1e-8, weight_decay=0.1, t=t, max_norm=1.0)
        losses.append(r[0])
    return np.array(losses)


def test_two_runs_same_bits_with_flex(flex):
    """Same init and batches, twice with graphs and once launched directly: identical losses,
    parameters and Adam state, bit for bit."""
    params = init_params(M, seed=9)
    out = []
    for graphs in (True, True, False):
        gpu = make(M, 4, "bf16", attention="cudnn")
        try:
            assert gpu.build.flex is not None, gpu.notes
            assert gpu.build.ops.flex is gpu.build.flex, "the backend does not hand its flex backward to Ops"
            calls = _count_runs(gpu)
            gpu.use_graphs = graphs
            gpu.load_params(params)
            losses = _train(gpu, 4)
            # launched directly: once per layer per step; with graphs: per layer per capture
            # (T 256 and 199, and any other key the fused step captures), none per replay
            assert calls[0] == 4 * M.n_layer if not graphs else calls[0] >= 2 * M.n_layer, calls
            m, v = gpu.read_optimizer()
            out.append((losses, gpu.read_params(), m, v))
        finally:
            gpu.close()
    for other in out[1:]:
        for a, b in zip(out[0], other, strict=True):
            assert np.array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.slow
def test_sigterm_resume_with_flex_is_bit_exact(flex, tmp_path: Path,
                                              prepared_data: Path) -> None:
    """A micro model with head dim 64 and seq_len 128, the flex backward on (the default) and
    stopped at step K: its checkpoints' config says so; resumed, it runs on with it (the log
    says so), bit for bit the run straight with it."""
    c = micro_config_dict(max_steps=N, precision="bf16")
    c["model"].update(d_model=128, n_head=2, seq_len=128)
    c["gpu"] = {"gemm_tune": True}
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps(c))
    run = tmp_path / "stopped"
    stop_at_k(cfg, run, CUDA)
    assert checkpoint_gpu(run)["flex_backward"] is True
    plan = (run / "gemm_plan.json").read_text()
    train(cfg, run, ("--resume", *CUDA))
    log = (run / "engine.log").read_text()
    starts = [line for line in log.splitlines() if "cuda: attention" in line]
    assert len(starts) == 2 and all(FLEX in s for s in starts), log[-3000:]
    assert_same_as_straight(tmp_path, cfg, run, plan, CUDA)
