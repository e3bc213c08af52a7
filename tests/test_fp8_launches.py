"""The FP8 GEMMs' launches without a GPU: engine/backends/cuda/fp8.py's Fp8Gemms on the real Ops,
whose kernels and GEMMs are stand-ins that check every launch against the kernel's declared
argument formats (runtime.SIGNATURES, themselves checked against the .cu sources by
test_cuda_sources.py) and record the calls. A wrong argument count or kind would otherwise be
found only on a GPU, at start."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from engine.backends.cuda.cublas import R_32F
from engine.backends.cuda.fp8 import HISTORY, TENSORS, Fp8Gemms, plan_fp8
from engine.backends.cuda.gemm import R_8F_E4M3, R_8F_E5M2
from engine.backends.cuda.memory import Plan
from engine.backends.cuda.ops import Ops
from engine.backends.cuda.runtime import SIGNATURES
from engine.errors import RunError
from engine.model.fp8 import ATTN_GEMMS, DELAYED

L, d, F, R = 2, 128, 512, 256
ARG_RANGE = {"P": (0, 2**64), "q": (-(2**63), 2**63), "i": (-(2**31), 2**31)}


class Kernel:
    def __init__(self, name: str, calls: list[tuple[str, tuple[int, ...]]]) -> None:
        self.name, self.calls = name, calls

    def prepared_async_call(self, grid: tuple[int, int], block: tuple[int, int, int],
                            stream: Any, *args: Any, shared_size: int = 0) -> None:
        fmt = SIGNATURES[self.name]
        assert len(args) == len(fmt), f"{self.name}: {len(args)} arguments, declared {fmt}"
        for code, a in zip(fmt, args, strict=True):
            lo, hi = ARG_RANGE[code]
            assert isinstance(a, (int, np.integer)) and lo <= int(a) < hi, (self.name, fmt, args)
        assert all(g >= 1 for g in grid), (self.name, grid)
        self.calls.append((self.name, tuple(int(a) for a in args)))


class Gemm:
    """LtGemm's surface that Ops and Fp8Gemms use; every matmul recorded."""

    def __init__(self) -> None:
        self.tuning, self.timer = False, None
        self.choices: dict[str, str] = {}
        self.choice_ms: dict[str, tuple[float, float]] = {}
        self.plan_imported = False
        self.matmuls: list[dict[str, Any]] = []
        # (M, N, K, first operand's type) of the FP8 GEMMs that cuBLASLt refuses
        self.refuse: set[tuple[int, int, int, int]] = set()
        self.log: list[tuple[str, tuple[int, ...]]] | None = None  # the kernels' calls too

    def matmul(self, out: int, a: int, b: int, M: int, N: int, K: int, **kw: Any) -> None:
        if "scales" in kw and (M, N, K, kw["types"][0]) in self.refuse:
            raise RunError(f"no FP8 algorithm for {M}x{N}x{K}")
        self.matmuls.append({"out": out, "a": a, "b": b, "M": M, "N": N, "K": K, **kw})
        if self.log is not None:
            self.log.append(("gemm fp8" if "scales" in kw else "gemm bf16", (a, b)))


class Stream:
    handle = 0

    def synchronize(self) -> None:
        pass


class Drv:
    """mem_alloc's far-apart bases; the history's copies recorded."""

    class Mem(int):
        def free(self) -> None:
            pass

    def __init__(self) -> None:
        self.next, self.copies = 0x7F00_0000_0000, []

    def mem_alloc(self, nbytes: int) -> Mem:
        mem = self.Mem(self.next)
        self.next += (nbytes // 2**30 + 2) * 2**30
        return mem

    def memcpy_htod(self, ptr: int, host: np.ndarray) -> None:
        self.copies.append(("htod", int(ptr), host.nbytes))

    def memcpy_dtoh(self, host: np.ndarray, ptr: int) -> None:
        host[...] = 0
        self.copies.append(("dtoh", int(ptr), host.nbytes))


def make(qkv: bool) -> tuple[Fp8Gemms, Ops, list, Gemm, Drv]:
    calls: list[tuple[str, tuple[int, ...]]] = []
    gemm, drv = Gemm(), Drv()
    ops = Ops({name: Kernel(name, calls) for name in SIGNATURES}, None, Stream(), "bf16",
              gemm=gemm, ws=1 << 20)
    ops.zero32 = lambda ptr, count: calls.append(("memset", (int(ptr), count)))  # the driver's
    plan = Plan()
    plan_fp8(plan, L, d, F, R, qkv=qkv)
    plan.allocate(drv)
    return Fp8Gemms(ops, drv, plan, L, d, F, ops.act, R, qkv=qkv), ops, calls, gemm, drv


@pytest.fixture
def mlp() -> tuple[Fp8Gemms, Ops, list, Gemm, Drv]:
    return make(qkv=True)


def one_pass(fp8: Fp8Gemms, qkv: bool = True) -> None:
    """A training pass's FP8 work in the Network's order (the QKV map's where it runs in FP8)."""
    base = 0x1000_0000
    fp8.begin_pass()
    for layer in range(L):
        w = base + 0x100_0000 * layer
        if qkv:
            fp8.cast_qkv_weights(layer, w + 0x40_0000)
            fp8.qkv_forward(layer, base, base, base, R)
        fp8.cast_proj_weights(layer, w + 0x60_0000)
        fp8.proj_forward(layer, base, base, base, R)
        fp8.cast_mlp_weights(layer, w, w + 0x80_0000)
        fp8.mlp_forward(layer, base, base, base, base, base, base, R)
    for layer in reversed(range(L)):
        fp8.mlp_backward(layer, base, base, base, base, base, base, base, base, base, base, R)
        fp8.proj_backward(layer, base, base, base, base, base, R)
        if qkv:
            fp8.qkv_backward(layer, base, base, base, base, base, R)
    fp8.end_pass()


# each cast kernel's (qt, hist) argument positions: the weights', x's and dy's casts, and the
# GELU's and its gradient's, computed by the kernels that cast them
CAST_ARGS = {"k_fp8_cast_t": (1, 5), "k_fp8_cast_t64": (1, 5), "k_fp8_cast_t_f32": (1, 5),
             "k_fp8_cast_t64_f32": (1, 5), "k_fp8_gelu_cast_t64": (1, 6),
             "k_fp8_dgelu_cast_t64": (1, 7)}


def casts(calls: list[tuple[str, tuple[int, ...]]]) -> list[tuple[str, int, int]]:
    """(kernel, qt, hist) of every cast, in order."""
    return [(n, a[CAST_ARGS[n][0]], a[CAST_ARGS[n][1]]) for n, a in calls if n in CAST_ARGS]


def test_every_launch_of_a_pass_matches_its_kernels_declaration(mlp) -> None:
    fp8, _, calls, gemm, drv = mlp
    assert [c[0] for c in drv.copies] == ["htod", "htod"]  # the history zeroed at construction
    one_pass(fp8)
    names = [n for n, _ in calls]
    # per layer the delayed amax passes (no-ops once a tensor has a history) over the four
    # weights' masters, the activations x, ln1, att and the gradients dy, dproj, dqkv, and
    # GELU(pre) and its gradient; the weights' copies (W_QKV's in three blocks) and eight
    # activation and gradient casts (the GELU's two by the kernels that compute them); one
    # record, after the last backward
    assert names.count("k_fp8_amax_f32_delayed") == 4 * L
    assert names.count("k_fp8_amax_delayed") == 6 * L
    assert names.count("k_fp8_gelu_amax_delayed") == names.count("k_fp8_dgelu_amax_delayed") == L
    assert names.count("k_fp8_gelu_cast_t64") == names.count("k_fp8_dgelu_cast_t64") == L
    assert "k_mlp_gelu_fwd" not in names and "k_mlp_gelu_bwd" not in names
    assert names.count("k_fp8_record") == 1 and names[-1] == "k_fp8_record"
    assert names[0] == "memset"  # the amax words zeroed when the pass begins
    cs = casts(calls)
    assert len(cs) == 6 * L + 8 * L
    # every cast reads its own history row: each of the twelve tensors of each layer, once,
    # but W_QKV's (its three blocks, one scale)
    assert TENSORS == DELAYED and len(DELAYED) == 12
    hist = fp8.buf["hist"]
    rows = [(h - hist) // (4 * HISTORY) for _, _, h in cs]
    assert all(h for _, _, h in cs)
    wqkv = [layer * len(DELAYED) + DELAYED.index("wqkv") for layer in range(L)]
    assert sorted(rows) == sorted([*range(L * len(DELAYED)), *wqkv, *wqkv])
    # the record reads the amax words (twelve a layer, in the history's row order) into
    # HISTORY slots
    [rec] = [a for n, a in calls if n == "k_fp8_record"]
    assert rec[3:] == (L * len(DELAYED), len(DELAYED), len(TENSORS), HISTORY) == \
        (L * 12, 12, 12, HISTORY)
    # the twelve GEMMs of each layer, FP8 operand types on each
    assert len(gemm.matmuls) == 12 * L and all("scales" in m for m in gemm.matmuls)


def test_with_q_k_v_in_slabs_the_qkv_gemms_run_in_bf16_and_have_no_copies() -> None:
    fp8, _, calls, gemm, _ = make(qkv=False)
    assert not {"wqkv", "wqkvt", "ln1", "ln1t", "dqkv", "dqkvt"} & set(fp8.buf)
    assert fp8.fp8_gemms == [g for g in fp8.use if not g.startswith("qkv")]
    assert len(fp8.fp8_gemms) == 9
    one_pass(fp8, qkv=False)
    assert len(gemm.matmuls) == 9 * L and all("scales" in m for m in gemm.matmuls)
    assert [n for n, _ in calls].count("k_fp8_record") == 1


def test_the_qkv_map_reads_w_qkv_in_rows_and_batches_its_weight_gradient(mlp) -> None:
    """W_Q, W_K, W_V's masters (one after another) are cast into W_QKV [d,3d]'s column blocks
    (rows 3d bytes apart) and into its transpose [3d,d] (one block after another), under one
    amax word, scale and history row; the forward is one GEMM [R,d]·[d,3d] (b: the transposed
    copy), the input gradient one over K = 3d (b: W_QKV in rows), the weight gradient three
    [d,d] GEMMs batched over dqkv's column blocks (its transposed copy's row blocks) into the
    gradients' layout."""
    fp8, _, calls, gemm, _ = mlp
    wq = 0x5000_0000
    fp8.begin_pass()
    fp8.cast_qkv_weights(1, wq)
    word, inv = fp8._scale(1, "wqkv")
    h = fp8._hist(1, "wqkv")
    [amax] = [a for n, a in calls if n == "k_fp8_amax_f32_delayed"]
    assert amax == (word, wq, 3 * d * d, h, HISTORY)  # W_Q, W_K, W_V's masters together
    cast = [a for n, a in calls if n == "k_fp8_cast_t64_f32"]
    rows_at, t_at = fp8._w("wqkv", 1), fp8._w("wqkvt", 1)
    # (q, qt, inv, x, amax, hist, H, rows, cols, ldq, e5m2)
    assert cast == [(rows_at + j * d, t_at + j * d * d, inv, wq + 4 * j * d * d, word, h,
                     HISTORY, d, d, 3 * d, 0) for j in range(3)]
    gemm.matmuls.clear()
    ln1, qkv, w_rows = 0x6000_0000, 0x6100_0000, 0x6200_0000
    fp8.qkv_forward(1, ln1, w_rows, qkv, R)
    [fwd] = gemm.matmuls
    assert (fwd["out"], fwd["a"], fwd["b"], fwd["M"], fwd["N"], fwd["K"]) == \
        (qkv, fp8.buf["ln1"], t_at, R, 3 * d, d) and fwd["tb"]
    gemm.matmuls.clear()
    dqkv, dx, dw = 0x6300_0000, 0x6400_0000, 0x6500_0000
    fp8.qkv_backward(1, dqkv, ln1, w_rows, dx, dw, R)
    wgrad, dgrad = gemm.matmuls
    assert (wgrad["out"], wgrad["a"], wgrad["b"], wgrad["M"], wgrad["N"], wgrad["K"]) == \
        (dw, fp8._at("ln1", 1), fp8.buf["dqkvt"], d, d, R)
    assert (wgrad["batch"], wgrad["sa"], wgrad["sb"], wgrad["sc"]) == (3, 0, d * R, d * d)
    assert (dgrad["out"], dgrad["a"], dgrad["b"], dgrad["M"], dgrad["N"], dgrad["K"]) == \
        (dx, fp8.buf["dqkv"], rows_at, R, d, 3 * d) and dgrad["tb"]
    # dqkv's copies: [R,3d] as it is and transposed, E5M2
    [dq_cast] = [a for n, a in calls if n == "k_fp8_cast_t64" and a[3] == dqkv]
    assert dq_cast[:2] == (fp8.buf["dqkv"], fp8.buf["dqkvt"]) and dq_cast[7:] == (R, 3 * d, 1)


def test_the_qkv_weight_gradient_in_bf16_reads_dqkvs_column_blocks(mlp) -> None:
    """Chosen bf16, the QKV map's weight gradient is Ops.attn_qkv_bwd_rows's: three GEMMs
    batched over dqkv's column blocks (ldb 3d), into the gradients' layout."""
    fp8, _, _, gemm, _ = mlp
    gemm.choices[fp8.choice_key("qkv wgrad")] = "bf16"
    fp8.begin_pass()
    fp8.qkv_backward(0, 0x6300_0000, 0x6000_0000, 0x6200_0000, 0x6400_0000, 0x6500_0000, R)
    wgrad = gemm.matmuls[0]
    assert "scales" not in wgrad and wgrad["ta"]
    assert (wgrad["a"], wgrad["b"], wgrad["M"], wgrad["N"], wgrad["K"]) == \
        (0x6000_0000, 0x6300_0000, d, d, R)
    assert (wgrad["ldb"], wgrad["batch"], wgrad["sa"], wgrad["sb"], wgrad["sc"]) == \
        (3 * d, 3, 0, d, d * d)


def test_the_weights_are_scaled_from_their_history(mlp) -> None:
    """Each weight's amax pass over its fp32 master is the delayed one (a no-op once it has a
    history), and its cast reads that history (taking the amax as it goes): both with the
    weight's own history row and amax word, on its own master."""
    fp8, _, calls, _, _ = mlp
    masters = {(layer, name): 0x5000_0000 + 0x100_0000 * (2 * layer + k)
               for layer in range(L) for k, name in enumerate(("w1", "w2"))}
    fp8.begin_pass()
    for layer in range(L):
        fp8.cast_mlp_weights(layer, masters[layer, "w1"], masters[layer, "w2"])
    names = [n for n, _ in calls]
    assert "k_fp8_amax_f32" not in SIGNATURES and "k_fp8_amax_delayed" not in names
    amaxes = [a for n, a in calls if n == "k_fp8_amax_f32_delayed"]
    cast = [(n, a) for n, a in calls if n in ("k_fp8_cast_t_f32", "k_fp8_cast_t64_f32")]
    assert len(amaxes) == len(cast) == 2 * L
    hist = fp8.buf["hist"]
    for (layer, name), a, (_, c) in zip(masters, amaxes, cast, strict=True):
        word, _ = fp8._scale(layer, name)
        h = hist + 4 * HISTORY * (layer * len(DELAYED) + DELAYED.index(name))
        # k_fp8_amax_f32_delayed(amax, x, n, hist, H)
        assert a == (word, masters[layer, name], d * F, h, HISTORY)
        # k_fp8_cast_t*_f32(q, qt, inv, x, amax, hist, H, rows, cols, ldq, e5m2)
        assert c[3:7] == (masters[layer, name], word, h, HISTORY) and h != 0
        assert c[9] == c[8] and c[10] == 0  # rows as stored; E4M3
    # the amax words are each weight's own, after x, h, dy, dh of its layer
    words = [a[0] for a in amaxes]
    assert words == [fp8.buf["amax"] + 4 * (layer * 12 + t) for layer in range(L)
                     for t in (4, 5)]


def test_the_bf16_gelu_is_written_only_while_a_gemm_may_read_it(mlp) -> None:
    """The GELU's output (act) and its input's gradient (dpre) in bf16 are for a GEMM that runs
    in bf16: written in a pass at a length where their GEMMs have not run in FP8 yet, and in
    later passes only where one of them runs in bf16 (here fc1's weight gradient, chosen so)."""
    fp8, _, calls, gemm, _ = mlp
    base = 0x1000_0000  # one_pass's act and dpre

    def keeps() -> dict[str, set[int]]:
        out: dict[str, set[int]] = {"k_fp8_gelu_cast_t64": set(), "k_fp8_dgelu_cast_t64": set()}
        for n, a in calls:
            if n in out:
                out[n].add(a[3])
        calls.clear()
        return out

    gemm.choices[fp8.choice_key("fc1 wgrad")] = "bf16"
    one_pass(fp8)
    assert keeps() == {"k_fp8_gelu_cast_t64": {base}, "k_fp8_dgelu_cast_t64": {base}}
    one_pass(fp8)
    assert keeps() == {"k_fp8_gelu_cast_t64": {0}, "k_fp8_dgelu_cast_t64": {base}}


def test_a_gemm_chosen_bf16_runs_without_scales_and_the_pass_still_records(mlp) -> None:
    fp8, _, calls, gemm, _ = mlp
    gemm.choices[fp8.choice_key("fc2 dgrad")] = "bf16"
    one_pass(fp8)
    assert fp8.fp8_gemms == [g for g in fp8.use if g != "fc2 dgrad"]
    assert sum("scales" not in m for m in gemm.matmuls) == L  # fc2 dgrad, one a layer
    assert [n for n, _ in calls].count("k_fp8_record") == 1


def test_a_plan_without_fp8_choices_takes_the_mlps_as_fp8_and_times_the_attentions(
        mlp) -> None:
    """A GEMM plan recorded without these choices (an older engine's, or another precision's):
    the MLP's GEMMs run in FP8, as that run computed them, untimed; the attention's, which that
    run computed in bf16, are timed as in a new run (here FP8 the faster) and kept."""
    fp8, _, _, gemm, _ = mlp
    gemm.plan_imported = True

    def timer(fn: Any) -> float:
        n = len(gemm.matmuls)
        fn()
        return 0.5 if "scales" in gemm.matmuls[n] else 1.0

    gemm.tuning, gemm.timer = True, timer
    one_pass(fp8)
    assert all(gemm.choices[fp8.choice_key(g)] == "fp8" for g in fp8.use)
    assert set(gemm.choice_ms) == {fp8.choice_key(g) for g in ATTN_GEMMS}
    assert len(fp8.fp8_gemms) == 12


def test_the_history_travels_through_the_device_copies(mlp) -> None:
    fp8, _, _, _, drv = mlp
    h = fp8.read_history()
    assert h.amax.shape == (L * len(DELAYED), HISTORY) and h.next == 0
    assert drv.copies[-2:] == [("dtoh", fp8.buf["hist"], L * len(DELAYED) * HISTORY * 4),
                               ("dtoh", fp8.buf["next"], 4)]
    with pytest.raises(ValueError, match=f"expected {L * len(DELAYED)} tensors"):
        from engine.model.fp8 import AmaxHistory

        fp8.load_history(AmaxHistory.empty(L + 1))


# GEMMs by (M, N, K, first operand's type), as the fake cuBLASLt refuses them
FC2_FWD, FC2_WGRAD = (R, d, F, R_8F_E4M3), (F, d, R, R_8F_E4M3)
FC1_WGRAD, FC1_DGRAD = (d, F, R, R_8F_E4M3), (R, d, F, R_8F_E5M2)
# one_pass_apart's buffers, each at its own address
ACT, PRE, DPRE = 0x2000_0000, 0x2100_0000, 0x2200_0000


def one_pass_apart(fp8: Fp8Gemms) -> None:
    """The MLP's part of one_pass with every buffer apart, so that which one a launch reads
    shows."""
    other = iter(range(0x3000_0000, 0x4000_0000, 0x10_0000))
    fp8.begin_pass()
    for layer in range(L):
        fp8.cast_mlp_weights(layer, next(other), next(other))
        fp8.mlp_forward(layer, next(other), next(other), next(other), PRE, ACT, next(other), R)
    for layer in reversed(range(L)):
        fp8.mlp_backward(layer, next(other), next(other), next(other), next(other), PRE, ACT,
                         next(other), next(other), next(other), DPRE, R)
    fp8.end_pass()


@pytest.mark.parametrize(("refuse", "kernel", "args", "computed"), [
    # fc2's weight gradient reads act: both layers' forwards ran before the refusal, neither
    # wrote it
    ({FC2_WGRAD}, "k_mlp_gelu_fwd", (ACT, PRE, R * F, 0), L),
    # fc2 fwd reads act: layer 0's forward meets the refusal; layer 1's then writes act
    ({FC2_FWD}, "k_mlp_gelu_fwd", (ACT, PRE, R * F, 0), 1),
    # fc1's GEMMs read dpre: layer 1's backward meets the refusal (both of its GEMMs, GELU'
    # applied once); layer 0's then writes it
    ({FC1_DGRAD}, "k_mlp_gelu_bwd", (DPRE, DPRE, PRE, R * F, 0), 1),
    ({FC1_WGRAD}, "k_mlp_gelu_bwd", (DPRE, DPRE, PRE, R * F, 0), 1),
    ({FC1_WGRAD, FC1_DGRAD}, "k_mlp_gelu_bwd", (DPRE, DPRE, PRE, R * F, 0), 1),
])
def test_a_gemm_refused_after_its_operand_was_left_unwritten_has_it_computed_first(
        mlp, refuse: set, kernel: str, args: tuple[int, ...], computed: int) -> None:
    """A pass whose GELU casts wrote no bf16 copy (every GEMM ran in FP8 before at this
    length), then GEMMs refused in FP8 (as a new problem could be): the bf16 operand they read
    is computed first where the pass left it unwritten, from the right buffers, right before
    the bf16 GEMM; the next pass writes the copy itself again."""
    fp8, _, calls, gemm, _ = mlp
    gemm.log = calls
    one_pass_apart(fp8)
    one_pass_apart(fp8)  # every GEMM has run in FP8 at R: no bf16 copies
    calls.clear()
    gemm.refuse = refuse
    one_pass_apart(fp8)
    at = [i for i, (n, _) in enumerate(calls) if n == kernel]
    assert len(at) == computed
    for i in at:
        assert calls[i][1] == args
        assert next(n for n, _ in calls[i:] if n.startswith("gemm")) == "gemm bf16"
    assert sum(n == "gemm bf16" for n, _ in calls) == len(refuse) * L
    cast = "k_fp8_gelu_cast_t64" if kernel.endswith("fwd") else "k_fp8_dgelu_cast_t64"
    calls.clear()
    one_pass_apart(fp8)
    assert all(a[3] != 0 for n, a in calls if n == cast)  # the copy is written again
    assert kernel not in [n for n, _ in calls]


@pytest.mark.parametrize("lp", [False, True])
def test_the_fp8_weight_gradients_are_written_as_the_gradient_buffer_holds_them(mlp, lp) -> None:
    """The FP8 weight-gradient GEMMs output what their buffer holds: float32 gradients, or, in a
    step that keeps the layers' weight gradients in bf16 (Ops.wgrad_lp, gpu.grads_low_precision),
    bf16 ones, written (beta 0), as the bf16 step's GEMMs write theirs; their operands stay
    E4M3 and E5M2. The other GEMMs' outputs are the activations'."""
    fp8, ops, _, gemm, _ = mlp
    ops.overwrite_grads = ops.wgrad_lp = lp
    one_pass(fp8)
    wgrads = [m for m in gemm.matmuls if m["types"][:2] == (R_8F_E4M3, R_8F_E5M2)]
    others = [m for m in gemm.matmuls if m["types"][:2] != (R_8F_E4M3, R_8F_E5M2)]
    assert len(wgrads) == 4 * L and len(others) == 8 * L
    assert all(m["types"][2] == (ops.act if lp else R_32F) for m in wgrads)
    assert all(m["beta"] == (0.0 if lp else 1.0) for m in wgrads)
    assert all(m["types"][2] == ops.act for m in others)

