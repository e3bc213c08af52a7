"""Every GEMM of the step through cuBLASLt, with the algorithm chosen by measurement and kept.

`LtGemm.matmul` speaks row-major like `Cublas.matmul` (out[M,N] = alpha·op(a)@op(b) + beta·out,
optional strided batching) and adds the GELU epilogues of the MLP (GELU_AUX forward, DGELU
backward). For each distinct problem — shape, transposes, leading dimensions, batch strides,
data types, epilogue, beta = 0 or not, pointer alignments — one algorithm is used for the whole
run, so the same shape always runs the same kernel (determinism, bit-exact resume).

How the algorithm is chosen (`tuning` on, during the backend's start-up pass): cuBLASLt's
heuristic proposes up to `candidates` algorithms (the config's gpu.gemm_candidates); each is run
and timed on the stream (CUDA events, one call at a time, the candidates in turn for
TIMING_ROUNDS rounds: `time_interleaved`), and the one with the lowest median is kept. The
heuristic's first choice was up to 20% slower than the best of 8 on the H200 (5% over all 22
problems of a step). Without tuning, an unseen problem takes the heuristic's first choice (a
deterministic function of the problem, the library version and the device).

The choices are exported as a plan (`export_plan`, a JSON-able dict: gemm_plan.GemmPlan) that
the run directory keeps as gemm_plan.json; `import_plan` makes a resumed run use the very same
algorithms (the opaque 64-byte cublasLtMatmulAlgo_t, checked with cublasLtMatmulAlgoCheck), so
resume never depends on re-timing. No pycuda here: timing is a callback the backend provides.
"""

from __future__ import annotations

import ctypes as C
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.backends.cuda.cublas import COMPUTE_32F, OP_N, OP_T, R_32F
from engine.backends.cuda.cublaslt import (
    DESC_AUX_LD,
    DESC_AUX_POINTER,
    DESC_EPILOGUE,
    DESC_TRANSA,
    DESC_TRANSB,
    EPILOGUE_DGELU,
    EPILOGUE_GELU_AUX,
    PREF_MAX_WORKSPACE,
    LtAlgo,
    LtHeuristic,
    load_cublaslt,
    lt_check,
    lt_set,
)
from engine.backends.cuda.gemm_plan import CHOICE_USES, choice_pair
from engine.config import GpuConfig
from engine.errors import RunError

CANDIDATES = GpuConfig().gemm_candidates  # heuristic proposals timed per problem, by default
TIMING_ROUNDS = 5  # timings of each candidate, taken in turn with the others (time_interleaved)
R_8F_E4M3, R_8F_E5M2 = 28, 29  # cudaDataType of FP8 operands (train/precision "fp8")
DESC_A_SCALE_POINTER, DESC_B_SCALE_POINTER, DESC_FAST_ACCUM = 17, 18, 25
ELEM_BYTES = {R_32F: 4, R_8F_E4M3: 1, R_8F_E5M2: 1}  # else 2 (bf16, fp16)
EPILOGUE_DEFAULT = 1
LAYOUT_BATCH_COUNT, LAYOUT_BATCH_OFFSET = 5, 6
PREF_MIN_ALIGN = (5, 6, 7, 8)  # A, B, C, D bytes
PLAN_VERSION = 1

EPILOGUE_NAMES = {EPILOGUE_DEFAULT: "none", EPILOGUE_GELU_AUX: "gelu_aux",
                  EPILOGUE_DGELU: "dgelu"}


def alignment(ptr: int) -> int:
    """The largest power of two (at most 256) that divides the address."""
    if ptr == 0:
        return 256
    return min(256, ptr & -ptr)


def problem_key(types: tuple[int, int, int], ta: bool, tb: bool, M: int, N: int, K: int,
                lda: int, ldb: int, ldc: int, batch: int, sa: int, sb: int, sc: int,
                beta_zero: bool, epilogue: int, aligns: tuple[int, int, int],
                fast_accum: bool = False) -> str:
    """The plan's name for one GEMM problem (row-major terms; stable across runs)."""
    t = "".join("T" if x else "N" for x in (ta, tb))
    epi = EPILOGUE_NAMES.get(epilogue, str(epilogue))
    return (f"{M}x{N}x{K} {t} types={types[0]},{types[1]},{types[2]} ld={lda},{ldb},{ldc} "
            f"batch={batch}:{sa},{sb},{sc} beta={'0' if beta_zero else '1'} epi={epi} "
            f"align={aligns[0]},{aligns[1]},{aligns[2]}" + (" fast_accum" if fast_accum else ""))


def time_interleaved(timer: Callable[[Callable[[], None]], float],
                     fns: list[Callable[[], None]], rounds: int = TIMING_ROUNDS) -> list[float]:
    """The median of `rounds` timings of each of fns, taken in turn, so that a slow spell of the
    GPU (its clock meeting the power limit) falls on one round of every candidate instead of on
    all of one candidate's timings (on the H200, five consecutive timings of one candidate can
    all come out 1.5x its usual time, and the slower variant would be kept). Every other round runs the other way (fns[0], ..., fns[-1], fns[-1], ...,
    fns[0], ...), so that a steady drift adds as much to each. timer(fn) times one fn()."""
    times: list[list[float]] = [[] for _ in fns]
    for r in range(rounds):
        order = range(len(fns)) if r % 2 == 0 else range(len(fns) - 1, -1, -1)
        for j in order:
            times[j].append(timer(fns[j]))
    return [statistics.median(t) for t in times]


@dataclass
class _Problem:
    desc: C.c_void_p
    layouts: tuple[C.c_void_p, C.c_void_p, C.c_void_p]  # A, B, C(=D) in cuBLASLt's terms
    algo: LtAlgo | None = None
    ms: float | None = None
    rank: int | None = None
    top1_ms: float | None = None
    candidates: int | None = None
    source: str = ""  # "timed", "heuristic" or "plan"


class LtGemm:
    """cuBLASLt GEMMs with one algorithm per problem. Streams and workspaces are given per call
    (`matmul(..., stream=, ws=)`), so a second stream with its own workspace shares the choices.
    """

    def __init__(self, workspace_bytes: int, device: str, candidates: int = CANDIDATES) -> None:
        """candidates: heuristic proposals timed per problem while tuning (a recorded plan
        keeps the choice, so a resume does not depend on it)."""
        lib = load_cublaslt()
        vp = C.c_void_p
        self._lib = lib
        self.handle = vp()
        self._check(lib.cublasLtCreate(C.byref(self.handle)), "cublasLtCreate")
        self.ws_bytes = workspace_bytes
        self.library = f"cublasLt {int(lib.cublasLtGetVersion())}"
        self.device = device
        self.candidates = candidates
        self._problems: dict[str, _Problem] = {}
        self._imported: dict[str, bytes] = {}
        self._imported_plan: dict[str, Any] = {}  # exported again as it came
        # an MLP GEMM -> "epilogue" | "kernel" (ops.py: GELU in the epilogue or not); a linear
        # map's GEMM -> "fp8" | "bf16" (fp8.py: in FP8 or not)
        self.choices: dict[str, str] = {}
        self.choice_ms: dict[str, tuple[float, float]] = {}  # the timings behind a choice
        self.tuning = False
        self.timer: Callable[[Callable[[], None]], float] | None = None
        self.warnings: list[str] = []

    _check = staticmethod(lt_check)
    _set = staticmethod(lt_set)

    # --- the problems -----------------------------------------------------------------------------
    def _describe(self, types: tuple[int, int, int], ta: bool, tb: bool, M: int, N: int, K: int,
                  lda: int, ldb: int, ldc: int, batch: int, sa: int, sb: int, sc: int,
                  epilogue: int, aux_ld: int, fast_accum: bool = False) -> _Problem:
        """Descriptors in cuBLASLt's column-major terms: D[N,M] = op(b)·op(a) (operands swap,
        as in Cublas.matmul)."""
        lib, vp = self._lib, C.c_void_p
        desc = vp()
        self._check(lib.cublasLtMatmulDescCreate(C.byref(desc), COMPUTE_32F, R_32F), "desc")
        sd = lib.cublasLtMatmulDescSetAttribute
        opa, opb = (OP_T if tb else OP_N), (OP_T if ta else OP_N)
        self._set(sd, desc, DESC_TRANSA, C.c_int32(opa))
        self._set(sd, desc, DESC_TRANSB, C.c_int32(opb))
        if epilogue != EPILOGUE_DEFAULT:
            self._set(sd, desc, DESC_EPILOGUE, C.c_uint32(epilogue))
            self._set(sd, desc, DESC_AUX_LD, C.c_int64(aux_ld))
        if fast_accum:  # FP8: accumulate without the periodic fp32 promotion (forward only)
            self._set(sd, desc, DESC_FAST_ACCUM, C.c_int8(1))
        a_rows, a_cols = (N, K) if opa == OP_N else (K, N)
        b_rows, b_cols = (K, M) if opb == OP_N else (M, K)
        layouts = []
        for dtype, rows, cols, ld, stride in ((types[1], a_rows, a_cols, ldb, sb),
                                              (types[0], b_rows, b_cols, lda, sa),
                                              (types[2], N, M, ldc, sc)):
            lay = vp()
            self._check(lib.cublasLtMatrixLayoutCreate(C.byref(lay), dtype, rows, cols, ld),
                        "layout")
            if batch > 1:
                sl = lib.cublasLtMatrixLayoutSetAttribute
                self._set(sl, lay, LAYOUT_BATCH_COUNT, C.c_int32(batch))
                self._set(sl, lay, LAYOUT_BATCH_OFFSET, C.c_int64(stride))
            layouts.append(lay)
        return _Problem(desc, (layouts[0], layouts[1], layouts[2]))

    def _heuristics(self, p: _Problem, aligns: tuple[int, int, int], n: int) -> list[LtHeuristic]:
        lib, vp = self._lib, C.c_void_p
        pref = vp()
        self._check(lib.cublasLtMatmulPreferenceCreate(C.byref(pref)), "preference")
        try:
            sp = lib.cublasLtMatmulPreferenceSetAttribute
            self._set(sp, pref, PREF_MAX_WORKSPACE, C.c_uint64(self.ws_bytes))
            # cuBLASLt's A is our b, its B our a; C and D share aligns[2] (matmul: the lower)
            for attr, al in zip(PREF_MIN_ALIGN, (aligns[1], aligns[0], aligns[2], aligns[2]),
                                strict=True):
                self._set(sp, pref, attr, C.c_uint32(al))
            results, count = (LtHeuristic * n)(), C.c_int(0)
            la, lb, lc = p.layouts
            status = lib.cublasLtMatmulAlgoGetHeuristic(self.handle, p.desc, la, lb, lc, lc,
                                                        pref, n, results, C.byref(count))
        finally:
            lib.cublasLtMatmulPreferenceDestroy(pref)
        if status != 0:
            return []
        return [results[i] for i in range(count.value) if results[i].state == 0]

    def _run(self, p: _Problem, algo: LtAlgo, out: int, a: int, b: int, alpha: float, beta: float,
             aux: int, stream: int, ws: int, scales: tuple[int, int] = (0, 0)) -> int:
        """One cublasLtMatmul: D = C = out (in place)."""
        vp = C.c_void_p
        sd = self._lib.cublasLtMatmulDescSetAttribute
        if aux:
            self._set(sd, p.desc, DESC_AUX_POINTER, vp(aux))
        if scales[0] or scales[1]:  # FP8: the inverse scales; cuBLASLt's A is our b
            self._set(sd, p.desc, DESC_A_SCALE_POINTER, vp(scales[1]))
            self._set(sd, p.desc, DESC_B_SCALE_POINTER, vp(scales[0]))
        al, be = C.c_float(alpha), C.c_float(beta)
        la, lb, lc = p.layouts
        return self._lib.cublasLtMatmul(self.handle, p.desc, C.byref(al), vp(b), la, vp(a), lb,
                                        C.byref(be), vp(out), lc, vp(out), lc, C.byref(algo),
                                        vp(ws), self.ws_bytes, vp(stream))

    def _choose(self, key: str, p: _Problem, aligns: tuple[int, int, int],
                run: Callable[[LtAlgo], int]) -> None:
        """Pick p.algo: from an imported plan, by timing the candidates, or the heuristic's
        first."""
        if key in self._imported:
            algo = LtAlgo.from_buffer_copy(self._imported[key])
            res = LtHeuristic()
            la, lb, lc = p.layouts
            if self._lib.cublasLtMatmulAlgoCheck(self.handle, p.desc, la, lb, lc, lc,
                                                 C.byref(algo), C.byref(res)) == 0:
                p.algo, p.source = algo, "plan"
                return
            self.warnings.append(f"gemm plan: the recorded algorithm for {key} is not valid "
                                 f"here; the heuristic's choice runs instead")
        cands = self._heuristics(p, aligns, self.candidates if self.tuning else 1)
        if not cands:
            raise RunError(f"cuBLASLt proposes no algorithm for the GEMM {key}")
        p.candidates = len(cands)
        if not (self.tuning and self.timer and len(cands) > 1):
            p.algo, p.rank, p.source = cands[0].algo, 0, "heuristic"
            return
        # Each candidate runs several times. With beta 0 every run rewrites D from inputs it
        # does not touch, so the last run's output is the right one; an in-place beta 1 (a
        # gradient accumulation) adds once per run, which is why the backend tunes in a start-up pass
        # whose state it zeroes afterwards.
        runs: list[tuple[int, Callable[[], None]]] = []
        for i, h in enumerate(cands):
            if run(h.algo) != 0:  # refused at run time: nothing was launched
                continue
            runs.append((i, lambda algo=h.algo: self._check(run(algo), f"cublasLtMatmul {key}")))
        if not runs:
            raise RunError(f"cuBLASLt: no proposed algorithm runs the GEMM {key}")
        medians = time_interleaved(self.timer, [fn for _, fn in runs])
        times = [(ms, i) for ms, (i, _) in zip(medians, runs, strict=True)]
        ms, best = min(times)
        p.algo, p.ms, p.rank, p.source = cands[best].algo, ms, best, "timed"
        p.top1_ms = next((t for t, i in times if i == 0), None)
        run(p.algo)  # the chosen one last: its output is the one left in `out`

    # --- the GEMM ---------------------------------------------------------------------------------
    def matmul(self, out: int, a: int, b: int, M: int, N: int, K: int, *,
               types: tuple[int, int, int], stream: int, ws: int, ta: bool = False,
               tb: bool = False, lda: int | None = None, ldb: int | None = None,
               ldc: int | None = None, alpha: float = 1.0, beta: float = 0.0, batch: int = 1,
               sa: int = 0, sb: int = 0, sc: int = 0, epilogue: int = EPILOGUE_DEFAULT,
               aux: int = 0, scales: tuple[int, int] = (0, 0), fast_accum: bool = False
               ) -> None:
        """Row-major out[M,N] = epilogue(alpha·op(a)@op(b) + beta·out); a is [M,K] (stored
        [K,M] when ta), b is [K,N] (stored [N,K] when tb); ld* row strides, s* batch strides, in
        elements; types = (a, b, out) cudaDataType. GELU_AUX also writes the pre-activation to aux, DGELU reads it from aux (both [M,N]
        with row stride ldc). FP8 operands (types R_8F_E4M3/E5M2): `scales` are device pointers
        to a's and b's inverse scales, and Hopper takes them only as a [M,K], b stored [N,K]
        (ta False, tb True); fast_accum."""
        lda = lda if lda is not None else (M if ta else K)
        ldb = ldb if ldb is not None else (K if tb else N)
        ldc = ldc if ldc is not None else N
        # what every row of every batch matrix is aligned to: the base, the row stride and the
        # batch stride (in bytes), so the heuristic only proposes algorithms that can run them
        esz = tuple(ELEM_BYTES.get(t, 2) for t in types)

        def align(ptr: int, ld: int, stride: int, es: int) -> int:
            al = min(alignment(ptr), alignment(ld * es))
            return min(al, alignment(stride * es)) if batch > 1 and stride else al

        # C = D and aux get one alignment, the lower of the two: the heuristic then only
        # proposes algorithms that can read and write them where they are
        aligns = (align(a, lda, sa, esz[0]), align(b, ldb, sb, esz[1]),
                  min(align(out, ldc, sc, esz[2]), align(aux, ldc, 0, esz[2])))
        key = problem_key(types, ta, tb, M, N, K, lda, ldb, ldc, batch, sa, sb, sc, beta == 0.0,
                          epilogue, aligns, fast_accum)
        p = self._problems.get(key)
        fresh = p is None
        if p is None:
            p = self._problems[key] = self._describe(types, ta, tb, M, N, K, lda, ldb, ldc,
                                                     batch, sa, sb, sc, epilogue, ldc, fast_accum)

        def run(algo: LtAlgo) -> int:
            return self._run(p, algo, out, a, b, alpha, beta, aux, stream, ws, scales)

        if fresh:
            try:
                self._choose(key, p, aligns, run)
            except BaseException:
                del self._problems[key]
                raise
            if p.source == "timed":
                return  # _choose ran the chosen algorithm last
        assert p.algo is not None
        self._check(run(p.algo), f"cublasLtMatmul {key}")

    # --- the plan ---------------------------------------------------------------------------------
    def import_plan(self, plan: dict[str, Any] | None) -> str:
        """Use the recorded algorithms of `plan` (GemmPlan.to_json()) for the problems it names.
        Returns "" or why the plan is not used (another device or library: re-timed)."""
        if not plan:
            return ""
        if plan.get("library") != self.library or plan.get("device") != self.device:
            return (f"the GEMM plan was made with {plan.get('library')} on {plan.get('device')}; "
                    f"this is {self.library} on {self.device}: timing the GEMMs again")
        self._imported = {}
        self._imported_plan = plan
        for k, v in (plan.get("choices") or {}).items():
            use = v.get("use") if isinstance(v, dict) else v
            if use in CHOICE_USES:
                self.choices[str(k)] = use
        for key, entry in (plan.get("gemms") or {}).items():
            try:
                raw = bytes.fromhex(str(entry.get("algo", "")))
            except ValueError:
                continue
            if len(raw) == C.sizeof(LtAlgo):
                self._imported[str(key)] = raw
        return ""

    @property
    def plan_imported(self) -> bool:
        """Whether a recorded plan was accepted (import_plan): choices it lacks were then not
        made by the run that wrote it."""
        return bool(self._imported_plan)

    def export_plan(self) -> dict[str, Any]:
        """The chosen algorithms as GemmPlan.to_json() fields: an imported plan's entries as they
        came, and the problems timed here (a heuristic first choice is a function of the
        problem and needs no record)."""
        gemms = dict(self._imported_plan.get("gemms") or {})
        for key, p in sorted(self._problems.items()):
            if p.algo is None or p.source != "timed":
                continue
            gemms[key] = {"algo": bytes(p.algo).hex(), "ms": p.ms, "rank": p.rank,
                          "top1_ms": p.top1_ms, "candidates": p.candidates}
        def finite(x: float | None) -> float | None:
            return x if x is not None and math.isfinite(x) else None

        choices = dict(self._imported_plan.get("choices") or {})
        for k, v in sorted(self.choices.items()):
            if k in self.choice_ms:  # timed here: its pair's times, in the pair's order
                first, second = choice_pair(v)
                choices[k] = {"use": v, f"{first}_ms": finite(self.choice_ms[k][0]),
                              f"{second}_ms": finite(self.choice_ms[k][1])}
        return {"version": PLAN_VERSION, "library": self.library, "device": self.device,
                "gemms": gemms, "choices": choices}

    def timing_summary(self) -> tuple[int, float, float]:
        """(problems timed, Σ best ms, Σ heuristic-first ms) over the problems timed here."""
        timed = [p for p in self._problems.values()
                 if p.source == "timed" and p.ms is not None and p.top1_ms is not None]
        return len(timed), sum(p.ms for p in timed), sum(p.top1_ms for p in timed)

    def close(self) -> None:
        if self.handle:
            self._lib.cublasLtDestroy(self.handle)
            self.handle = C.c_void_p()


__all__ = ["EPILOGUE_DEFAULT", "EPILOGUE_DGELU", "EPILOGUE_GELU_AUX", "LtGemm", "alignment",
           "problem_key"]
