"""The forward's residual adds in the GEMM epilogues (ANDREA_RESID_GEMM), checked on the CPU: no
GPU, no pycuda.

`Ops.attn_out_fwd(..., resid=)` and `Ops.mlp_fwd(..., resid=)` run through `EmuGemm`
(tests/emugemm.py, LtGemm.matmul's contract in numpy over a fake device memory, a separate C
included) and are compared with numpy's projection then `residual_add`, in float64; without
resid they must stay today's product (the output's old contents never read). Then `LtGemm.matmul`
itself over a stand-in for libcublasLt: which pointers cublasLtMatmul gets as C and D, the
alignment the heuristic is told for C and D, and the problem key. The GEMMs themselves, in bf16
and fp32, run in tests/gpu (test_ops, test_fusions)."""

from __future__ import annotations

import statistics
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from engine.backends.cuda import gemm as gemm_mod
from engine.backends.cuda.cublas import R_16BF
from engine.backends.cuda.cublaslt import EPILOGUE_GELU_AUX
from engine.backends.cuda.gemm import PREF_MIN_ALIGN, TIMING_ROUNDS, LtGemm
from engine.backends.cuda.ops import Ops
from engine.backends.numpy import ops as npo
from tests.emugemm import EPILOGUE_DEFAULT, emulated_ops

R, D, F = 3 * 37, 48, 80


@pytest.fixture(autouse=True)
def _no_device_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ANDREA_CUDA_SYNC", raising=False)  # Ops would wait on the fake stream


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(11)


# --- the ops, through the emulated GEMMs ------------------------------------------------------


@pytest.mark.parametrize("with_resid", [True, False])
def test_attn_out_fwd_adds_the_residual_in_its_gemm(rng, with_resid):
    """resid: out = resid + y @ W_O in one GEMM (beta 1, C = resid, which stays as it was);
    without: out = y @ W_O, the output's old contents (finite garbage) never read."""
    o, emu = emulated_ops()
    y, w, x = rng.normal(0, 1, (R, D)), rng.normal(0, 0.2, (D, D)), rng.normal(0, 1, (R, D))
    want = np.empty((R, D))
    npo.attn_out_fwd(y, w, want)
    if with_resid:
        npo.residual_add(x, want.copy(), want)
    dy, dw, dx = emu.put(y), emu.put(w), emu.put(x)
    out = emu.put(rng.normal(0, 1, (R, D)))
    o.attn_out_fwd(dy, dw, out, R, D, resid=dx if with_resid else 0)
    np.testing.assert_allclose(emu.get(out, (R, D)), want, rtol=1e-12, atol=1e-12)
    assert np.array_equal(emu.get(dx, (R, D)), x), "the residual was written"
    (call,) = emu.log
    assert (call["c"], call["beta"]) == ((dx, 1.0) if with_resid else (0, 0.0))


@pytest.mark.parametrize("variant", ["epilogue", "kernel"])
@pytest.mark.parametrize("with_resid", [True, False])
def test_mlp_fwd_adds_the_residual_in_its_second_gemm(rng, variant, with_resid):
    """Both GELU variants (GELU in the first GEMM's epilogue, or the plain GEMM and
    k_mlp_gelu_fwd): pre and act as numpy's, and out = resid + act @ W_2 from the second GEMM
    (beta 1, C = resid) or, without resid, act @ W_2; the first GEMM takes no C either way."""
    o, emu = emulated_ops()
    o.gemm.choices[f"mlp_fwd R={R} d={D} F={F}"] = variant
    x = rng.normal(0, 1, (R, D))
    w1, w2 = rng.normal(0, 0.2, (D, F)), rng.normal(0, 0.1, (F, D))
    r = rng.normal(0, 1, (R, D))
    pre, act, want = np.empty((R, F)), np.empty((R, F)), np.empty((R, D))
    npo.mlp_fwd(x, w1, w2, pre, act, want)
    if with_resid:
        npo.residual_add(r, want.copy(), want)
    dx, d1, d2, dr = emu.put(x), emu.put(w1), emu.put(w2), emu.put(r)
    dpre, dact = emu.alloc(R * F), emu.alloc(R * F)
    out = emu.put(rng.normal(0, 1, (R, D)))
    o.mlp_fwd(dx, d1, d2, dpre, dact, out, R, D, F, resid=dr if with_resid else 0)
    np.testing.assert_allclose(emu.get(dpre, (R, F)), pre, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(emu.get(dact, (R, F)), act, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(emu.get(out, (R, D)), want, rtol=1e-12, atol=1e-12)
    assert np.array_equal(emu.get(dr, (R, D)), r), "the residual was written"
    fc1, fc2 = emu.log
    assert fc1["epilogue"] == (EPILOGUE_GELU_AUX if variant == "epilogue" else EPILOGUE_DEFAULT)
    assert (fc1["c"], fc1["beta"]) == (0, 0.0)
    assert (fc2["out"], fc2["c"], fc2["beta"]) == ((out, dr, 1.0) if with_resid else
                                                   (out, 0, 0.0))
    assert o.k["k_mlp_gelu_fwd"].launches == (variant == "kernel")
    assert o.fused_gelu_calls == (variant == "epilogue")


class _Recorder:
    """A plain cuBLAS handle (or a kernel) that records what it is asked to run."""

    def __init__(self) -> None:
        self.calls: list[Any] = []

    def matmul(self, *args: Any, **kw: Any) -> None:
        self.calls.append((args, kw))

    def prepared_async_call(self, *args: Any, **kw: Any) -> None:
        self.calls.append((args, kw))


def test_a_residual_in_the_gemm_needs_ltgemm():
    """The plain cuBLAS path (fusions off) has one C, written in place: a residual is refused
    before anything runs, and without one it runs as before."""
    blas, gelu = _Recorder(), _Recorder()
    o = Ops({"k_mlp_gelu_fwd": gelu}, blas, SimpleNamespace(handle=0), "fp32")
    with pytest.raises(ValueError, match="needs LtGemm"):
        o.attn_out_fwd(1 << 12, 2 << 12, 3 << 12, R, D, resid=4 << 12)
    with pytest.raises(ValueError, match="needs LtGemm"):
        o.mlp_fwd(1 << 12, 2 << 12, 3 << 12, 4 << 12, 5 << 12, 6 << 12, R, D, F, resid=7 << 12)
    with pytest.raises(ValueError, match="needs LtGemm"):
        o._mm(3 << 12, 1 << 12, 2 << 12, R, D, D, beta=1.0, c=4 << 12)
    assert blas.calls == [] and gelu.calls == []
    o.attn_out_fwd(1 << 12, 2 << 12, 3 << 12, R, D)
    o.mlp_fwd(1 << 12, 2 << 12, 3 << 12, 4 << 12, 5 << 12, 6 << 12, R, D, F)
    assert len(blas.calls) == 3 and len(gelu.calls) == 1
    assert all(kw["beta"] == 0.0 and "c" not in kw for _, kw in blas.calls)


# --- LtGemm.matmul over a stand-in for libcublasLt ----------------------------------------------


class FakeLt:
    """libcublasLt as LtGemm calls it, on the CPU: every call succeeds and the heuristic
    proposes `n` algorithms. Recorded: the C/D minimum alignments of each heuristic query and
    (C, D, beta) of each cublasLtMatmul."""

    def __init__(self, n: int = 1) -> None:
        self.n = n
        self.aligns: list[tuple[int, int]] = []
        self.matmuls: list[tuple[int, int, float]] = []
        self.algos: list[int] = []  # the candidate (its index) each cublasLtMatmul ran
        self._pref: dict[int, int] = {}

    def cublasLtGetVersion(self) -> int:
        return 130000

    def cublasLtMatmulPreferenceSetAttribute(self, pref, attr, value, size) -> int:
        self._pref[attr] = value._obj.value
        return 0

    def cublasLtMatmulAlgoGetHeuristic(self, handle, desc, la, lb, lc, ld, pref, n, results,
                                       count) -> int:
        self.aligns.append((self._pref[PREF_MIN_ALIGN[2]], self._pref[PREF_MIN_ALIGN[3]]))
        for i in range(min(self.n, n)):
            results[i].algo.data[0] = i  # state 0: usable
        count._obj.value = min(self.n, n)
        return 0

    def cublasLtMatmul(self, handle, desc, alpha, b, la, a, lb, beta, c, lc, d, ld, algo, ws,
                       ws_bytes, stream) -> int:
        self.matmuls.append((c.value or 0, d.value or 0, beta._obj.value))
        self.algos.append(algo._obj.data[0])
        return 0

    def __getattr__(self, name: str):  # descriptors, layouts, preferences: created, set, freed
        return lambda *args: 0


@pytest.fixture
def lt(monkeypatch: pytest.MonkeyPatch):
    def make(n: int = 1) -> tuple[LtGemm, FakeLt]:
        fake = FakeLt(n)
        monkeypatch.setattr(gemm_mod, "load_cublaslt", lambda: fake)
        return LtGemm(1 << 20, "fake device"), fake

    return make


M, N, K = 16, 256, 128  # bf16 rows of 256 and 512 bytes: every row stride 256-byte aligned
OUT, CPTR, A, B = 1 << 20, 2 << 20, 3 << 20, 4 << 20
BF16 = (R_16BF, R_16BF, R_16BF)


def mm(g: LtGemm, **kw: Any) -> None:
    g.matmul(OUT, A, B, M, N, K, types=BF16, stream=0, ws=0, **kw)


def test_a_separate_c_goes_to_cublas_as_c_and_out_as_d(lt):
    g, fake = lt()
    mm(g, beta=1.0, c=CPTR)
    assert fake.matmuls == [(CPTR, OUT, 1.0)]
    mm(g, beta=1.0)  # in place: C is D
    mm(g, beta=1.0, c=OUT)
    assert fake.matmuls[1:] == [(OUT, OUT, 1.0)] * 2


def test_a_c_as_aligned_as_d_shares_the_in_place_problem(lt):
    """The heuristic sees layouts and alignments, not pointers: one problem (one heuristic
    query, one key, one algorithm) for in place and a separate C of the same alignment, so a
    recorded plan's keys do not change."""
    g, fake = lt()
    mm(g, beta=1.0)
    mm(g, beta=1.0, c=CPTR)
    assert len(g._problems) == 1 and fake.aligns == [(256, 256)]
    (key,) = g._problems
    assert key.endswith("beta=1 epi=none align=256,256,256"), key


@pytest.mark.parametrize("offset", [2, 8, 16])
def test_a_less_aligned_c_lowers_the_alignment_of_c_and_d(lt, offset):
    """C `offset` bytes past a 256-byte boundary (D on one): the heuristic is told that
    alignment for both C and D (so it proposes no algorithm that assumes more of C), and the
    problem is a new one, keyed by it."""
    g, fake = lt()
    mm(g, beta=1.0, c=CPTR)
    mm(g, beta=1.0, c=CPTR + offset)
    assert fake.aligns == [(256, 256), (offset, offset)]
    assert len(g._problems) == 2
    assert any(k.endswith(f"align=256,256,{offset}") for k in g._problems), list(g._problems)
    assert fake.matmuls[-1] == (CPTR + offset, OUT, 1.0)


def test_a_c_that_overlaps_d_is_refused(lt):
    g, fake = lt()
    span = ((M - 1) * N + N) * 2
    for c in (OUT + 2 * N, OUT - span + 2, OUT + span - 2):
        with pytest.raises(ValueError, match="overlaps D"):
            mm(g, beta=1.0, c=c)
    assert fake.matmuls == []
    mm(g, beta=1.0, c=OUT + span)  # just past D, and just before it
    mm(g, beta=1.0, c=OUT - span)
    assert [m[0] for m in fake.matmuls] == [OUT + span, OUT - span]


def test_timing_runs_every_candidate_from_c_into_d(lt):
    """While tuning, each of the heuristic's candidates runs several times (and the chosen one
    last): every run reads the separate C and writes D, so D ends as C + product whatever ran
    before (with C = D each run would add again)."""
    g, fake = lt(n=3)
    runs = []

    def timer(fn) -> float:
        for _ in range(3):
            fn()
        runs.append(len(fake.matmuls))
        return float(len(runs))

    g.tuning, g.timer = True, timer
    mm(g, beta=1.0, c=CPTR)
    (p,) = g._problems.values()
    assert p.source == "timed" and p.candidates == 3 and len(runs) == 3 * TIMING_ROUNDS
    # a trial run of each, then one timed run of each per round; the choice last
    assert len(fake.matmuls) == 3 * (1 + 3 * TIMING_ROUNDS) + 1
    assert set(fake.matmuls) == {(CPTR, OUT, 1.0)}


def test_candidates_are_timed_in_turn_so_a_drifting_clock_does_not_pick(lt):
    """The GPU slows as it heats toward its power limit: here every timing comes out 3% slower
    than the one before. Candidate 1 is the fastest (0.95 against 1.00 and 1.10). Timed one
    candidate after the other, the drift would make candidate 0 look fastest; timed in turn,
    every other round the other way, each candidate's median sees the same clocks, and
    candidate 1 is kept."""
    g, fake = lt(n=3)
    true = [1.00, 0.95, 1.10]
    order = []

    def timer(fn) -> float:
        fn()
        order.append(fake.algos[-1])
        return true[fake.algos[-1]] * (1 + 0.03 * len(order))

    g.tuning, g.timer = True, timer
    mm(g)
    (p,) = g._problems.values()
    assert order == ([0, 1, 2, 2, 1, 0] * TIMING_ROUNDS)[: 3 * TIMING_ROUNDS]
    assert p.source == "timed" and p.rank == 1 and p.algo.data[0] == 1
    assert fake.algos[-1] == 1  # the choice runs last: its output is the one left
    sequential = [statistics.median(t * (1 + 0.03 * (i * TIMING_ROUNDS + k + 1))
                                    for k in range(TIMING_ROUNDS)) for i, t in enumerate(true)]
    assert min(range(3), key=sequential.__getitem__) == 0  # what one-after-the-other would keep


@pytest.mark.parametrize("epilogue_runs", [True, False])
def test_the_mlp_variants_are_timed_in_turn_and_the_choice_runs_last(epilogue_runs):
    """Ops._gelu_variant while tuning: the epilogue GEMM and the GEMM + kernel each run once (each
    picks its algorithm), then are timed in turn; the faster is recorded and runs last, so its
    outputs are the ones left. An epilogue cuBLASLt refuses leaves the kernel variant."""
    from engine.errors import RunError

    calls = []

    def epilogue() -> None:
        calls.append("e")
        if not epilogue_runs:
            raise RunError("no epilogue here")

    def kernel() -> None:
        calls.append("k")

    def timer(fn) -> float:
        fn()
        return 1.0 if calls[-1] == "e" else 2.0

    lt = SimpleNamespace(choices={}, tuning=True, timer=timer, choice_ms={})
    ops = SimpleNamespace(gemm=lt, fused_gelu_calls=0)
    Ops._gelu_variant(ops, "mlp_fwd test", epilogue, kernel)
    if epilogue_runs:
        timed = (["e", "k", "k", "e"] * TIMING_ROUNDS)[: 2 * TIMING_ROUNDS]
        assert calls == ["e", "k", *timed, "e"]
        assert lt.choices == {"mlp_fwd test": "epilogue"} and lt.choice_ms["mlp_fwd test"] == (1, 2)
        assert ops.fused_gelu_calls == 1
    else:
        assert calls == ["e", "k", *["k"] * TIMING_ROUNDS, "k"]
        assert lt.choices == {"mlp_fwd test": "kernel"} and ops.fused_gelu_calls == 0
