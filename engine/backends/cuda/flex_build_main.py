"""The build step of the flex attention backward, run in its own interpreter (flex_build.py).

Run as a script by the interpreter that has CuTe DSL (nvidia-cutlass-dsl), apache-tvm-ffi and
nvidia-cudnn-frontend installed (Python 3.12 wheels), never imported by the engine's process:
it installs a stand-in `torch` module and package placeholders in `sys.modules`, which must not
leak into anything else. It imports nothing from the engine, so it runs from a bare file path.

    python flex_build_main.py probe
        prints one JSON line: the three packages' versions, the frontend's directory and the
        run-time libraries' paths (libcute_dsl_runtime.so, libtvm_ffi.so). Imports none of them.
    python flex_build_main.py compile OBJ NAME HEAD_DIM DTYPE [OVERRIDES]
        compiles the fused wrapper (preprocess, main kernel, dQ postprocess) for sm_90a with
        symbolic B, T, H and strides, and writes OBJ with `export_to_c(OBJ, NAME)`: an ELF object
        whose C entry point is `__tvm_ffi_<NAME>`. OVERRIDES: a JSON object of BWD_CONFIG keys
        and values (dev/flex-variants; without it, BWD_CONFIG as it is). Prints one JSON line
        with the compile time, the config compiled (`bwd_config`, `postprocess`, `overrides`) and
        `plan_mask_words` (below).
Errors (an unknown key, a value of another type than BWD_CONFIG's, tile_m or tile_n other than
128, an assert of the kernels (with its file, line and source), the DSL's) print one JSON line
{"error": ...} and exit 3.

The entry point's arguments, in the order of `ARG_NAMES` (all tensors DLTensor*, device CUDA):
  mQ mK mV mO mdO  bf16 [B, T, H, 64], any strides that are multiples of 8 elements, last stride 1
  mLSE        f32 [B, H, T], last stride 1
  mdQ mdK mdV like mQ
  mLSE2 mdPsum f32 [B, H, T] (scratch, written by the preprocess)
  mdQacc      f32 [B, H, T·64] (scratch: with deterministic, each query block's rank-0 dQ
              contribution stores and the others add, and nothing zeroes it (`first_dq_stores`);
              without (a variant), the preprocess zeroes it and every contribution adds)
  mSem        i32 [B, H, T/128, 1] (must be zero on entry)
  cnt idx fcnt fidx order forder off foff masks (flex_plan.py)
  scale (float), seqlen (int). The stream is TVM FFI's environment stream for the first tensor's
  device. `ARG_NAMES` is the one definition of that order: the wrapper's parameters are checked
  against it before compiling, the fake arguments are built from it, `compile` prints it (the
  manifest keeps it) and flex_build.py reads it from this file's source (never importing it) for
  flex_call.py, which builds its argument array by name.
The kernels' constructor arguments: `BWD_CONFIG`, the main kernel's (FlexAttentionBackwardSm90),
today the frontend's own for SM90, hd 64, deterministic (dispatch.py:1383-1395, 1616-1634;
backward_config.py:104-115); the preprocess and the dQ postprocess take what they need from it
as the frontend's dispatch derives it (`kernel_args`: dispatch.py:1485-1494, 1806-1824), but for
the dQ accumulator: with deterministic the preprocess is not given it (`first_dq_stores`).
tile_m and tile_n stay 128: flex_plan.py's plan is in 128x128 blocks.
The plan depends on two other entries (flex_plan.py builds it for BWD_CONFIG as it is):
- SdP_swapAB: the masks' bits follow the S/dP MMA's accumulator layout, which it transposes.
  `plan_mask_words` ([256][2] uint32, the diagonal block's words, bit v%32 of word v//32 set
  where thread t's value v has key <= query) is computed from the DSL's own partition of that
  MMA as the frontend's planner does (plan/kernels/materialize_sm90.py:441-465); with
  SdP_swapAB=True it equals flex_plan.diagonal_mask_words.
- spt (with deterministic): the dQ write ranks (`order`, `forder`) are m - n with spt (the
  descending key-block walk), n without (plan/kernels/common.py:283-302); ranks made for the
  other walk can leave a block waiting on mSem for good.
Only BWD_CONFIG as it is goes into the engine's library (flex_build.build_library); a library
built with overrides (flex_build.build_variant) is for dev/bench_flex_configs.py, which
adapts the plan to its manifest.
"""

# No `from __future__ import annotations`: cute.jit reads the wrapper's annotations as objects.
import contextlib
import importlib.metadata
import importlib.util
import inspect
import json
import os
import sys
import time
import types
from pathlib import Path

FRONTEND = "nvidia-cudnn-frontend"
DSL = "nvidia-cutlass-dsl"
TVM_FFI = "apache-tvm-ffi"
LIBS_CU13 = "nvidia-cutlass-dsl-libs-cu13"
# The entry point's parameters, in order (a literal: flex_build.py reads it with ast).
ARG_NAMES = ("mQ", "mK", "mV", "mO", "mdO", "mLSE", "mdQ", "mdK", "mdV", "mLSE2", "mdPsum",
             "mdQacc", "mSem", "cnt", "idx", "fcnt", "fidx", "order", "forder", "off", "foff",
             "masks", "scale", "seqlen")
# The main kernel's constructor arguments (a literal: flex_build.py reads it with ast); the
# frontend's for SM90, hd <= 64 (backward_config.py:104-115, dispatch.py:1383-1395: dQ_swapAB is
# dispatch's, False unless hd 256 and not deterministic). `compile` takes overrides of them.
BWD_CONFIG = {"deterministic": True, "spt": True, "tile_m": 128, "tile_n": 128, "Q_stage": 2,
              "dO_stage": 2, "PdS_stage": 2, "SdP_swapAB": True, "dKV_swapAB": False,
              "AtomLayoutNdKV": 2, "AtomLayoutMdQ": 2, "dQ_single_wg": False, "dQ_swapAB": False}
PLAN_TILE = 128  # flex_plan.TILE: tile_m and tile_n are fixed to it
MMA_THREADS = 256  # the two MMA warpgroups (backward_config.py: _SM90_BWD_NUM_MMA_THREADS)


def _package_dir(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)  # top-level names: finds without importing
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def probe() -> dict:
    """Versions and paths; raises LookupError naming what is missing."""
    out: dict = {"python": sys.version.split()[0]}
    for key, dist in (("frontend", FRONTEND), ("dsl", DSL), ("tvm_ffi", TVM_FFI)):
        try:
            out[key + "_version"] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            raise LookupError(f"the package {dist} is not installed for {sys.executable}") from None
    try:
        out["libs_cu13_version"] = importlib.metadata.version(LIBS_CU13)
    except importlib.metadata.PackageNotFoundError:
        out["libs_cu13_version"] = None  # the runtime library check below says what to install
    cudnn_dir = _package_dir("cudnn")
    if cudnn_dir is None or not (cudnn_dir / "flex_attention" / "kernels" / "sm90").is_dir():
        raise LookupError(f"{FRONTEND} has no flex_attention/kernels/sm90 (looked in {cudnn_dir})")
    out["cudnn_dir"] = str(cudnn_dir)
    dsl_dir = _package_dir("nvidia_cutlass_dsl")
    # cu13's: nvidia-cutlass-dsl also installs libs-cu12, and the DSL compiles for the newest
    # toolkit flavor the driver takes (cu13 here and on the H200); cu12's was never run
    runtime = dsl_dir / "cu13" / "lib" / "libcute_dsl_runtime.so" if dsl_dir else None
    if runtime is None or not runtime.is_file():
        raise LookupError(f"libcute_dsl_runtime.so not found under {dsl_dir}/cu13/lib (install "
                          "nvidia-cutlass-dsl-libs-cu13: pip install 'andrea[flex]')")
    out["runtime_lib"] = str(runtime)
    tvm_dir = _package_dir("tvm_ffi")
    tvm_lib = tvm_dir / "lib" / "libtvm_ffi.so" if tvm_dir else None
    if tvm_lib is None or not tvm_lib.is_file():
        raise LookupError(f"libtvm_ffi.so not found under {tvm_dir}")
    out["tvm_ffi_lib"] = str(tvm_lib)
    return out


def install_stand_ins(cudnn_dir: Path) -> str:
    """Package placeholders for cudnn and cudnn.flex_attention (their __init__ needs pybind and
    torch), then `prepare_torch()`. Returns what it says."""
    for name, path in (("cudnn", cudnn_dir), ("cudnn.flex_attention", cudnn_dir / "flex_attention")):
        m = types.ModuleType(name)
        m.__path__ = [str(path)]
        sys.modules[name] = m
    return prepare_torch()


def prepare_torch() -> str:
    """Make `import torch` work for the kernel modules; returns which torch they get.

    A real torch, when this interpreter has one (tvm_ffi imports it at import when installed,
    so it may already be in `sys.modules`), is used as is: "torch <version>". Only when none is
    importable a stand-in goes into `sys.modules`, with what the kernel modules touch at import
    time: "stand-in". A stand-in never replaces a real torch."""
    if "torch" not in sys.modules and importlib.util.find_spec("torch") is not None:
        importlib.import_module("torch")  # the real one: the frontend imports fine with it
    if "torch" in sys.modules:
        return f"torch {getattr(sys.modules['torch'], '__version__', '?')}"

    class DType:
        def __init__(self, name: str, itemsize: int) -> None:
            self.name, self.itemsize = name, itemsize

        def __repr__(self) -> str:
            return "torch." + self.name

    torch = types.ModuleType("torch")
    torch.dtype = DType
    torch.Tensor = type("Tensor", (), {})
    for n, size in (("float16", 2), ("bfloat16", 2), ("float32", 4), ("int32", 4), ("int64", 8),
                    ("uint32", 4), ("uint8", 1), ("bool", 1)):
        setattr(torch, n, DType(n, size))
    sub = types.ModuleType("torch._subclasses")
    fake = types.ModuleType("torch._subclasses.fake_tensor")
    fake.FakeTensor = type("FakeTensor", (), {})
    sub.fake_tensor = fake
    guards = types.ModuleType("torch._guards")
    guards.active_fake_mode = lambda: None
    torch._subclasses, torch._guards = sub, guards
    sys.modules.update({"torch": torch, "torch._subclasses": sub,
                        "torch._subclasses.fake_tensor": fake, "torch._guards": guards})
    return "stand-in"


def bwd_config(overrides: dict | None = None) -> dict:
    """BWD_CONFIG with `overrides` applied. ValueError for a key BWD_CONFIG lacks, a value of
    another type than BWD_CONFIG's (bool for bool, int for int), or tile_m / tile_n other than
    PLAN_TILE; the kernels' constructors check the rest (their asserts)."""
    if overrides is None:
        overrides = {}
    if not isinstance(overrides, dict):
        raise ValueError(f"overrides must be a JSON object, got {type(overrides).__name__}")
    unknown = sorted(set(overrides) - set(BWD_CONFIG))
    if unknown:
        raise ValueError(f"unknown BWD_CONFIG keys {unknown} (known: {sorted(BWD_CONFIG)})")
    for key, value in overrides.items():
        want = type(BWD_CONFIG[key])
        if type(value) is not want:  # exact: a bool is not an int here, nor an int a bool
            raise ValueError(f"BWD_CONFIG[{key!r}] takes {want.__name__}, got "
                             f"{type(value).__name__} {value!r}")
        if key in ("tile_m", "tile_n") and value != PLAN_TILE:
            raise ValueError(f"{key} is fixed to {PLAN_TILE}: the plan (flex_plan.py) is in "
                             f"{PLAN_TILE}x{PLAN_TILE} blocks, got {value}")
    return {**BWD_CONFIG, **overrides}


def kernel_args(cfg: dict) -> dict:
    """What the preprocess and the dQ postprocess take from the main kernel's config, as the
    frontend's dispatch derives it for SM90 (not hd 256): the preprocess's tile_m
    (dispatch.py:1485-1494), and the postprocess's tile_m, num_threads (128 with dQ_single_wg,
    else 256), atom layout (AtomLayoutMdQ), swap (dQ_swapAB) and accum_row_major (False for dQ)
    (dispatch.py:1806-1824)."""
    return {"pre_tile_m": cfg["tile_m"], "post_tile_m": cfg["tile_m"],
            "post_num_threads": 128 if cfg["dQ_single_wg"] else 256,
            "post_atom_layout": cfg["AtomLayoutMdQ"], "post_swap_ab": cfg["dQ_swapAB"],
            "post_accum_row_major": False}


# The PTX of a dQ contribution: a bulk copy of the tile from shared to global memory where its
# write rank ($3) is 0 (the query block's first contribution), the frontend's bulk float add
# into the accumulator otherwise. Both complete through the same bulk group, which the kernel
# waits on before it passes the query block's semaphore to the next rank.
DQ_STORE_OR_ADD_PTX = (
    "{\n.reg .pred first;\nsetp.eq.s32 first, $3, 0;\n"
    "@first cp.async.bulk.global.shared::cta.bulk_group [$0], [$1], $2;\n"
    "@!first cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [$0], [$1], $2;\n}")


def dq_store_sites(cfg: dict) -> int:
    """The main kernel's dQ stores per trace: the partial and the full blocks' loops, each one
    per dQ warp group (two, or one with dQ_single_wg)."""
    return 2 * (1 if cfg["dQ_single_wg"] else 2)


@contextlib.contextmanager
def first_dq_stores(sites: int):
    """While the deterministic main kernel is compiled inside, its rank-0 dQ contribution to
    each query block is a store instead of an add.

    The frontend zeroes the float32 dQ accumulator in the preprocess (25 MB a layer at 120M)
    and then adds every key block's contribution to it in write-rank order. Where every query
    block has contributions of ranks 0, 1, ..., k-1 (the frontend's ranks and flex_plan.py's
    causal plan: rank 0 is the diagonal block with spt, key block 0 without), storing rank 0
    gives the same sums without the zeroing, and the preprocess is given no mdQacc. A mask with
    a query block that no key block reaches would leave that block unwritten. 0 + x = x in
    float (the bulk add rounds to nearest even and keeps subnormals), so the values are the
    frontend's way's but for the sign of a zero whose every contribution is -0.
    How: while the kernel is traced, `_store_one_dQaccum_sm90` (plan/kernels/packed_mask.py,
    SM90 dQ stores, which takes the rank as `lock_value`) runs with its rank on a stack, and the
    bulk add it calls (`copy_utils.cpasync_reduce_bulk_add_f32`) emits DQ_STORE_OR_ADD_PTX with
    that rank; outside it, the bulk add is the frontend's. On leaving, both are the frontend's
    again, and a ValueError says so where the trace did not emit `sites` of them
    (`dq_store_sites`): a frontend that no longer
    calls them so would otherwise leave the accumulator unzeroed and dQ wrong. Raises
    ValueError up front where the frontend no longer has these functions as TESTED_VERSIONS
    has them."""
    from cudnn.flex_attention._compat import copy_utils
    from cudnn.flex_attention.plan.kernels import packed_mask
    from cutlass import Int32
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import dsl_user_op

    store_one = getattr(packed_mask, "_store_one_dQaccum_sm90", None)
    bulk_add = getattr(copy_utils, "cpasync_reduce_bulk_add_f32", None)
    if (store_one is None or bulk_add is None
            or "lock_value" not in inspect.signature(store_one).parameters):
        raise ValueError("the frontend's SM90 dQ store is not the one first_dq_stores was "
                         "written for")
    ranks: list = []  # the write rank of the dQ contribution being traced
    emitted = 0

    @dsl_user_op
    def store_or_add(smem_ptr, gmem_ptr, store_bytes, *, loc=None, ip=None):
        nonlocal emitted
        if not ranks:
            return bulk_add(smem_ptr, gmem_ptr, store_bytes, loc=loc, ip=ip)
        llvm.inline_asm(
            None,
            [gmem_ptr.llvm_ptr, smem_ptr.toint(loc=loc, ip=ip).ir_value(),
             Int32(store_bytes).ir_value(), Int32(ranks[-1]).ir_value()],
            DQ_STORE_OR_ADD_PTX, "l,r,r,r", has_side_effects=True, is_align_stack=False)
        emitted += 1

    def store_one_ranked(*args, **kwargs):
        if not kwargs.get("deterministic") or "lock_value" not in kwargs:
            raise ValueError("first_dq_stores: a dQ store without deterministic=True and its rank")
        ranks.append(kwargs["lock_value"])
        try:
            return store_one(*args, **kwargs)
        finally:
            ranks.pop()

    copy_utils.cpasync_reduce_bulk_add_f32 = store_or_add
    packed_mask._store_one_dQaccum_sm90 = store_one_ranked
    try:
        yield
    finally:
        copy_utils.cpasync_reduce_bulk_add_f32 = bulk_add
        packed_mask._store_one_dQaccum_sm90 = store_one
    if emitted != sites:
        raise ValueError(f"first_dq_stores: the trace emitted {emitted} dQ stores-or-adds, "
                         f"expected {sites}")


def compile_object(obj: Path, name: str, head_dim: int, dtype: str,
                   overrides: dict | None = None) -> dict:
    """Compile the fused backward for sm_90a and write the ELF object `obj` exporting
    `__tvm_ffi_<name>`; returns `probe()` plus the compile time, `arg_names` (ARG_NAMES), which
    torch the kernel modules imported, the config (`bwd_config`, `postprocess`, `overrides`)
    and `plan_mask_words`. Raises ValueError for a head_dim other than 64, a dtype other than
    bf16/fp16 or a bad override (bwd_config), and whatever the kernels or the DSL raise."""
    if head_dim != 64:
        raise ValueError(f"head_dim {head_dim}: only 64 is built (the 128x128 tile config)")
    if dtype not in ("bf16", "fp16"):
        raise ValueError(f"dtype {dtype!r}: expected bf16 or fp16")
    cfg = bwd_config(overrides)
    derived = kernel_args(cfg)
    info = probe()
    os.environ["CUTE_DSL_ARCH"] = "sm_90a"  # no GPU here: name the target
    import cutlass  # before any stand-in: tvm_ffi and cutlass probe for torch at import
    import cutlass.cute as cute
    import tvm_ffi  # noqa: F401

    torch_used = install_stand_ins(Path(info["cudnn_dir"]))
    dt = cutlass.BFloat16 if dtype == "bf16" else cutlass.Float16
    flex_bwd = fused_wrapper(dt, head_dim, cfg, derived)
    params = tuple(inspect.signature(flex_bwd).parameters)
    if params != (*ARG_NAMES, "stream"):
        raise ValueError(f"the wrapper's parameters {params} differ from ARG_NAMES + stream")
    args = fake_arguments(dt, head_dim)
    t0 = time.time()
    zero_acc = not cfg["deterministic"]  # without write ranks (a variant) the adds need zeros
    with contextlib.nullcontext() if zero_acc else first_dq_stores(dq_store_sites(cfg)):
        fn = cute.compile(flex_bwd, *args, options="--enable-tvm-ffi")
    seconds = time.time() - t0
    fn.export_to_c(str(obj), name)
    words = plan_mask_words(cutlass, cute, dt, cfg)
    return {**info, "compile_s": round(seconds, 2), "object": str(obj),
            "symbol": "__tvm_ffi_" + name, "arg_names": list(ARG_NAMES), "torch": torch_used,
            "bwd_config": cfg, "postprocess": derived, "overrides": dict(overrides or {}),
            "plan_mask_words": words}


def fused_wrapper(dt, head_dim: int, cfg: dict, derived: dict):
    """The cute.jit wrapper that runs the preprocess, the main kernel (BWD_CONFIG `cfg`) and
    the dQ postprocess (`derived`: kernel_args) on one stream, its parameters ARG_NAMES and
    the stream. Imports the frontend's kernels: after install_stand_ins."""
    import cuda.bindings.driver as cuda
    import cutlass.cute as cute
    from cudnn.flex_attention.kernels.common.backward_postprocess import (
        FlexAttentionBackwardPostprocess,
    )
    from cudnn.flex_attention.kernels.common.backward_preprocess import (
        FlexAttentionBackwardPreprocess,
    )
    from cudnn.flex_attention.kernels.sm90.bwd.backward import FlexAttentionBackwardSm90
    from cudnn.flex_attention.plan.kernels import BlockSparseTensors
    from cutlass import Float32, Int32, const_expr

    zero_acc = not cfg["deterministic"]  # without write ranks (a variant) the adds need zeros
    # padded offsets for dPsum and LSE2, as the preprocess takes them by itself when it is
    # given mdQacc (they only matter with cu_seqlens, which this call has not)
    pre = FlexAttentionBackwardPreprocess(dt, head_dim, head_dim, derived["pre_tile_m"],
                                          use_padded_offsets=True)
    bwd_kernel = FlexAttentionBackwardSm90(dt, head_dim, head_dim, 1, **cfg)
    post = FlexAttentionBackwardPostprocess(
        dt, head_dim, 90, derived["post_tile_m"], derived["post_num_threads"],
        derived["post_atom_layout"], derived["post_swap_ab"], derived["post_accum_row_major"],
        use_2cta_instrs=False, cluster_size=1)

    @cute.jit
    def flex_bwd(mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 mdO: cute.Tensor, mLSE: cute.Tensor, mdQ: cute.Tensor, mdK: cute.Tensor,
                 mdV: cute.Tensor, mLSE2: cute.Tensor, mdPsum: cute.Tensor, mdQacc: cute.Tensor,
                 mSem: cute.Tensor, cnt: cute.Tensor, idx: cute.Tensor, fcnt: cute.Tensor,
                 fidx: cute.Tensor, order: cute.Tensor, forder: cute.Tensor, off: cute.Tensor,
                 foff: cute.Tensor, masks: cute.Tensor, scale: Float32, seqlen: Int32,
                 stream: cuda.CUstream):
        if const_expr(zero_acc):
            pre(mO, mdO, mdPsum, mLSE, mLSE2, mdQacc, None, None, seqlen, stream)
        else:
            pre(mO, mdO, mdPsum, mLSE, mLSE2, None, None, None, seqlen, stream)
        bs = BlockSparseTensors(cnt, idx, fcnt, fidx, None, order, forder, off, foff, masks,
                                None, None)
        bwd_kernel(mQ, mK, mV, mdO, mLSE2, mdPsum, mdQacc, mdK, mdV, scale, None, None, mSem,
                   None, None, bs, seqlen, seqlen, stream)
        post(mdQacc, mdQ, scale, None, seqlen, stream)

    return flex_bwd


def fake_arguments(dt, head_dim: int) -> list:
    """The compile's arguments in ARG_NAMES order, then the stream: fake tensors with symbolic
    B, T, H (shared: the entry point checks that all tensors agree) and strides (multiples of
    8 elements for the bf16 tensors), and TVM FFI's environment stream."""
    import cutlass.cute as cute
    from cutlass import Float32, Int32, Uint32

    mk, sym, sym64 = cute.runtime.make_fake_tensor, cute.sym_int, cute.sym_int64
    b, t, h = sym(), sym(), sym()

    def bshd():
        return mk(dt, (b, t, h, head_dim), stride=(sym64(divisibility=8), sym64(divisibility=8),
                                                    sym64(divisibility=8), 1), assumed_align=16)

    def f32(n):
        return mk(Float32, (b, h, n), stride=(sym64(divisibility=4), sym64(divisibility=4), 1),
                  assumed_align=16)

    def i32(n):
        return mk(Int32, (n,), stride=(1,), assumed_align=4)

    def row(n):
        return mk(Int32, (1, n), stride=(sym64(), 1), assumed_align=4)

    tr, tdr, rows, nnz, nfull = sym(), sym(), sym(), sym(), sym()
    fake = {name: bshd() for name in ("mQ", "mK", "mV", "mO", "mdO", "mdQ", "mdK", "mdV")}
    fake.update(
        mLSE=mk(Float32, (b, h, t), stride=(sym64(), sym64(), 1), assumed_align=4),
        mLSE2=f32(tr), mdPsum=f32(tr), mdQacc=f32(tdr),
        mSem=mk(Int32, (b, h, sym(), 1), stride=(sym64(), sym64(), 1, 1), assumed_align=4),
        cnt=row(rows), idx=i32(nnz), fcnt=row(rows), fidx=i32(nfull), order=i32(nnz),
        forder=i32(nfull), off=i32(sym()), foff=i32(sym()),
        masks=mk(Uint32, (nnz, 1, 256, 2), stride=(512, 512, 2, 1), assumed_align=16),
        scale=Float32(0.125), seqlen=Int32(0))
    args = [fake[name] for name in ARG_NAMES]
    args.append(cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True))
    return args


def plan_mask_words(cutlass, cute, dt, cfg: dict) -> list[list[int]]:
    """The diagonal (causal) block's mask words for the config's S/dP MMA, [MMA_THREADS][2]:
    bit v%32 of word v//32 of thread t set where its accumulator value v has key <= query. The
    coordinates are the DSL's partition of the MMA over an identity tensor, as the frontend's
    planner takes them (plan/kernels/materialize_sm90.py:441-465): (key, query) with SdP_swapAB,
    else (query, key)."""
    from cudnn.flex_attention.kernels.sm90.bwd.backward_config import make_sm90_bwd_tiled_mma_sdp

    tm, tn, swap = cfg["tile_m"], cfg["tile_n"], cfg["SdP_swapAB"]
    values = tm * tn // MMA_THREADS
    coords: list[tuple[int, int]] = []

    @cute.jit
    def partition():
        mma = make_sm90_bwd_tiled_mma_sdp(dt, tm, tn, swap)
        cS = cute.make_identity_tensor((tn, tm) if swap else (tm, tn))
        for t in cutlass.range_constexpr(MMA_THREADS):
            tScS = mma.get_slice(t).partition_C(cS)
            for v in cutlass.range_constexpr(values):
                c = tScS[v]
                coords.append((int(c[0]), int(c[1])))

    cute.compile(partition)
    if len(coords) != MMA_THREADS * values:
        raise ValueError(f"the S/dP MMA's partition gave {len(coords)} values, expected "
                         f"{MMA_THREADS * values}")
    words = []
    for t in range(MMA_THREADS):
        w = [0] * ((values + 31) // 32)
        for v in range(values):
            a, b = coords[t * values + v]
            key, query = (a, b) if swap else (b, a)
            if key <= query:
                w[v // 32] |= 1 << (v % 32)
        words.append(w)
    return words


def _where(e: BaseException) -> str:
    """For an assert (which says nothing itself): " (at FILE:LINE: SOURCE)" of the innermost
    frame in the frontend's kernels (the DSL's own for an assert in traced code), else the
    innermost; "" for anything else."""
    if not isinstance(e, AssertionError):
        return ""
    import traceback

    frames = traceback.extract_tb(e.__traceback__)
    if not frames:
        return ""
    ours = [f for f in frames if f"{os.sep}cudnn{os.sep}" in f.filename]
    f = (ours or frames)[-1]
    return f" (at {Path(f.filename).name}:{f.lineno}: {(f.line or '').strip()})"


def main(argv: list[str]) -> int:
    try:
        if argv[:1] == ["probe"]:
            out = probe()
        elif argv[:1] == ["compile"] and len(argv) in (5, 6):
            overrides = None
            if len(argv) == 6:
                try:
                    overrides = json.loads(argv[5])
                except json.JSONDecodeError as e:
                    raise ValueError(f"OVERRIDES is not JSON ({e}): {argv[5]!r}") from None
                if not isinstance(overrides, dict):
                    raise ValueError(f"OVERRIDES must be a JSON object, got {argv[5]!r}")
            out = compile_object(Path(argv[1]), argv[2], int(argv[3]), argv[4], overrides)
        else:
            raise ValueError("usage: flex_build_main.py probe | compile OBJ NAME HEAD_DIM DTYPE "
                             "[OVERRIDES]")
    except Exception as e:  # reported to the parent as one line; it raises RunError
        print(json.dumps({"error": f"{type(e).__name__}: {e}{_where(e)}"}))
        return 3
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
