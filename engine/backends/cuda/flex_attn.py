"""The flex deterministic attention backward in the CUDA backend (the config's
gpu.flex_backward, on by default, where it can run): whether it runs, where its library comes
from, its buffers, and the call.

It replaces only cuDNN's deterministic backward (ops.attn_bwd_cudnn): cuDNN's forward stays, and
the backward reads its output O and its stats (float32 [B,H,T,1], read as [B,H,T]: each row's
natural-log log-sum-exp of the scaled scores) with Q, K, V, dO and writes dQ, dK, dV in the
engine's rows (flex_call.py has the layout). Its bits differ from cuDNN's, so the choice is the
config's, which a run records and a resume keeps.

Where it runs (`refusal` says why not, "" where it can): cuDNN's attention with Q, K, V in rows
(CudnnAttention.rows), bf16 activations (fp8's attention is bf16 too), head dim 64, seq_len a
multiple of 128, compute capability 9.0 (the kernels are sm_90a's), and a library that loads
(`open_backward`). Anything else: cuDNN's deterministic backward, and the log says why
(attention_choice.AttentionChoice.pick_flex).

The library (`library_paths`): `ANDREA_FLEX_LIB`, a built `.so` with its manifest beside it
(scripts/flex-pack makes one to carry to a GPU machine), with libtvm_ffi.so and
libcute_dsl_runtime.so from its folder where they are there (else the manifest's paths, the
build machine's); without it, flex_build.build_library in `ANDREA_FLEX_CACHE` (default
$XDG_CACHE_HOME/andrea/flex) with the interpreter `ANDREA_FLEX_PYTHON` (default this one;
`pip install 'andrea[flex]'` gives it the packages), tried once per process.

One plan covers every step: the backward always runs at (the micro-batch, seq_len), the shape
cuDNN's graphs were built for; a shorter sequence runs that full length with the rows of dO past
T zeroed first (cudnn_attn.py), which add nothing to dK, dV of the rows before T here either
(dP = dO Vᵀ and the dO·O row sums are zero there). `FlexAttention.bwd` refuses any other shape.

Buffers (`plan_buffers`): the memory plan's "flex" group: flex.lse2, flex.dpsum, flex.dq_accum,
flex.dq_sem (flex_call.scratch_bytes) and the nine plan arrays flex.plan.<name>, uploaded once
(`bind`). dq_sem is zeroed by every call on the stream (flex_call.FlexBackward.run: a memset
node in the captured step, which graphs.py turns into a k_fill node like cuDNN's). The first
call loads the cubin: AttentionChoice.bind_flex makes it, eagerly on zeroed buffers, right after
`bind` and before any graph is captured; a RunError from either falls back to cuDNN's backward
(a fault that kills the context, or a kernel that never ends, cannot be caught so).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from engine import env
from engine.backends.cuda import flex_build
from engine.backends.cuda.flex_call import FlexArgs, FlexBackward, scratch_bytes
from engine.backends.cuda.flex_plan import FIELDS, HEAD_DIM, TILE, causal_plan
from engine.errors import RunError

TVM_FFI_NAME = "libtvm_ffi.so"
RUNTIME_NAME = "libcute_dsl_runtime.so"
GROUP = "flex"  # memory.GROUPS
SCRATCH = ("lse2", "dpsum", "dq_accum", "dq_sem")


def refusal(attention: str, rows: bool, precision: str, head_dim: int, seq_len: int,
            capability: tuple[int, int], rows_off: str = "") -> str:
    """Why the flex backward cannot run with these (the backend's resolved attention path,
    Q, K, V in rows, compute precision, head dim, seq_len, compute capability; rows_off: why
    the rows are off, AttentionChoice.rows_off); "" where it can (the library aside)."""
    if attention != "cudnn":
        return f"needs cuDNN's attention, and the {attention} attention runs"
    if not rows:
        return (f"needs Q, K, V in rows, and cuDNN runs them as slabs "
                f"({rows_off or 'gpu.qkv_rows is false'})")
    if precision != "bf16":
        return f"computes in bf16 only, not {precision}"
    if head_dim != HEAD_DIM:
        return f"needs head dim {HEAD_DIM} (d_model / n_head), the model has {head_dim}"
    if seq_len % TILE:
        return f"needs seq_len a multiple of {TILE}, got {seq_len}"
    if tuple(capability) != (9, 0):
        major, minor = capability
        return f"its kernels are sm_90a's (Hopper), this GPU is sm_{major}{minor}"
    return ""


def cache_dir() -> Path:
    """Where built libraries are cached: ANDREA_FLEX_CACHE, else $XDG_CACHE_HOME/andrea/flex
    (~/.cache/andrea/flex)."""
    given = env.FLEX_CACHE.read()
    if given:
        return Path(given)
    return Path(env.cache_home()) / "andrea" / "flex"


def library_paths() -> tuple[Path, str | None, str | None]:
    """(the library, libtvm_ffi.so, libcute_dsl_runtime.so): ANDREA_FLEX_LIB with the
    run-time libraries found in its folder (None: the manifest's), else a build in cache_dir()
    (the manifest's run-time libraries). RunError when ANDREA_FLEX_LIB names no file, or the
    build fails (flex_build.build_library: the interpreter, its packages, g++)."""
    given = env.FLEX_LIB.read()
    if given:
        lib = Path(given)
        if not lib.is_file():
            raise RunError(f"{env.FLEX_LIB.name}={given}: no such file")
        beside = [lib.parent / name for name in (TVM_FFI_NAME, RUNTIME_NAME)]
        tvm, runtime = (str(p) if p.is_file() else None for p in beside)
        return lib, tvm, runtime
    python = env.FLEX_PYTHON.read() or sys.executable
    key = (str(cache_dir()), python)
    if key not in _built:  # once per process: each CudaBackend start would probe again
        t0 = time.monotonic()
        try:
            _built[key], compiled = flex_build.build(cache_dir(), python=python)
        except RunError as e:
            _built[key] = e
        else:
            if compiled:  # not a cache hit: the start-up says why it took longer
                build_notes.append(f"the flex attention backward was built in "
                                   f"{time.monotonic() - t0:.0f} s into {cache_dir()} (once: "
                                   f"later starts load it)")
    got = _built[key]
    if isinstance(got, RunError):
        raise RunError(str(got))
    return got, None, None


# library_paths' builds in this process, by (cache directory, interpreter): the library, or the
# RunError that says why there is none (a build that failed is not tried again in the process)
_built: dict[tuple[str, str], Path | RunError] = {}
build_notes: list[str] = []  # what the builds said, for the run's log (AttentionChoice.pick_flex)


def open_backward(batch: int, seq_len: int, heads: int, device_id: int) -> FlexBackward:
    """The loaded FlexBackward for (B, T, H) on device `device_id`: library_paths, then the
    manifest's checks and the loads (flex_call). RunError or UserError with the reason."""
    lib, tvm, runtime = library_paths()
    return FlexBackward(lib, batch, seq_len, heads, tvm_ffi_lib=tvm, cute_runtime_lib=runtime,
                        device_id=device_id)


def plan_buffers(plan: Any, batch: int, seq_len: int, heads: int) -> None:
    """Add the flex buffers for (B, T, H) to a memory.Plan, in its "flex" group: the scratch
    (flex_call.scratch_bytes) and the plan arrays (flex_plan.causal_plan). Needs no library."""
    for name, nbytes in scratch_bytes(batch, seq_len, heads).items():
        plan.add(GROUP, f"flex.{name}", nbytes)
    for name, a in causal_plan(batch, seq_len).arrays():
        plan.add(GROUP, f"flex.plan.{name}", a.nbytes)


class FlexAttention:
    """The flex backward on the backend's buffers: `bind` once the plan is allocated, then
    `bwd` in place of cuDNN's backward (same stream)."""

    def __init__(self, backward: FlexBackward, scale: float) -> None:
        self.fb = backward
        self.B, self.T, self.H = backward.B, backward.T, backward.H
        self.scale = scale
        self._scratch: dict[str, int] = {}
        self._args: dict[tuple[int, ...], FlexArgs] = {}

    def bind(self, plan: Any, drv: Any) -> None:
        """Upload the plan arrays into their buffers (plan_buffers, allocated) and take the
        scratch's pointers; synchronous (at start)."""
        pointers = []
        for name, a in self.fb.plan_arrays():
            ptr = plan[f"flex.plan.{name}"]
            if a.size:
                drv.memcpy_htod(ptr, a)
            pointers.append(ptr)
        if [n for n, _ in self.fb.plan_arrays()] != list(FIELDS):
            raise RunError("flex attention: the plan's arrays are not in set_plan's order")
        self.fb.set_plan(pointers)
        self._scratch = {name: plan[f"flex.{name}"] for name in SCRATCH}

    def bwd(self, *, dout: int, qkv: int, out: int, stats: int, dqkv: int, B: int, T: int,
            stream: int) -> None:
        """dQ, dK, dV (overwritten, in rows of dqkv) from dO = dout, the forward's out and
        stats, on `stream` (a CUstream handle). B, T: the shape the backward runs at, which must
        be the plan's (RunError otherwise: the caller runs cuDNN's instead, see `fits`). The
        argument structs are made once per set of pointers (the layers' buffers)."""
        if not self.fits(B, T):
            raise RunError(f"flex attention: planned for B={self.B} T={self.T}, asked for "
                           f"B={B} T={T}")
        key = (qkv, out, dout, stats, dqkv)
        args = self._args.get(key)
        if args is None:
            s = self._scratch
            args = self.fb.make_args(qkv=qkv, o=out, do=dout, lse=stats, dqkv=dqkv,
                                     lse2=s["lse2"], dpsum=s["dpsum"], dq_accum=s["dq_accum"],
                                     dq_sem=s["dq_sem"], scale=self.scale)
            self._args[key] = args
        self.fb.run(args, stream)

    def fits(self, B: int, T: int) -> bool:
        """Whether (B, T) is the shape planned for."""
        return (B, T) == (self.B, self.T)
