"""The GPU runtime shared by every CudaBackend in a process: the device's primary context (so
cuBLAS and PyCUDA share it), one non-blocking stream, and the kernels compiled per precision.

Kernels are compiled with nvcc to a cubin for the device's exact architecture
(`-arch=sm_XY -std=c++17 -O3 -DANDREA_ACT=n`), cached by a hash of the sources and flags.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from engine import env
from engine.backends.cuda import KERNEL_DIR, graphs
from engine.errors import RunError

ACT_CODE = {"fp32": 0, "bf16": 1, "fp16": 2}
ACT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}

# Argument formats for PyCUDA's prepared launches: P pointer, i int32, q int64, f float32.
SIGNATURES: dict[str, str] = {
    "k_embed_fwd": "PPPPiii",
    "k_embed_fwd_rows": "PPPPiii",
    "k_fill": "Pqiiqq",
    "k_embed_bwd": "PPPPPPPiiii",
    "k_layernorm_fwd": "PPPPPPii",
    "k_layernorm_fwd_wide": "PPPPPPii",
    "k_residual_layernorm_fwd": "PPPPPPPPii",
    "k_residual_layernorm_fwd_wide": "PPPPPPPPii",
    "k_layernorm_bwd": "PPPPPPPiii",
    "k_layernorm_bwd_wide": "PPPPPPPiii",
    "k_layernorm_bwd_params": "PPPPPiii",
    "k_colsum_reduce": "PPiii",
    "k_attn_fwd": "PPiii",
    "k_attn_bwd": "PPPiii",
    "k_mlp_gelu_fwd": "PPqP",
    "k_mlp_gelu_bwd": "PPPqP",
    "k_residual_add": "PPPq",
    "k_residual_add_bwd": "PPPq",
    "k_loss_fwd": "PPPPiiii",
    "k_loss_bwd": "PPPPPiiii",
    "k_loss_fwd_bwd": "PPPPPPiiii",
    "k_loss_fwd_lp": "PPPPiiii",
    "k_loss_fwd_bwd_lp": "PPPPPPiiii",
    "k_grad_norm_partial": "PPqf",
    "k_grad_norm_final": "PPi",
    "k_grad_norm_ranges": "PPPPPifP",
    "k_grads_from_lp": "PPPPi",
    "k_grad_scale": "Pqf",
    "k_grad_add": "PPq",
    "k_adamw": "PPPPPPPPPPiiqffffffff",
    "k_adamw_step": "PPPPPPPPPPiiqqP",
    "k_step_clip": "PPPPP",
    "k_step_hp": "PP",
    "k_fp8_amax_delayed": "PPqPi",
    "k_fp8_amax_f32_delayed": "PPqPi",
    "k_fp8_cast_t": "PPPPPPiiii",
    "k_fp8_cast_t64": "PPPPPPiiii",
    "k_fp8_cast_t64_f32": "PPPPPPiiiii",
    "k_fp8_cast_t_f32": "PPPPPPiiiii",
    "k_fp8_record": "PPPiiii",
    "k_fp8_gelu_amax_delayed": "PPqPi",
    "k_fp8_dgelu_amax_delayed": "PPPqPi",
    "k_fp8_gelu_cast_t64": "PPPPPPPiii",
    "k_fp8_dgelu_cast_t64": "PPPPPPPPiii",
    "k_params_to_lp": "PPqPPii",
}


def nvcc_path() -> str | None:
    return shutil.which("nvcc") or next(
        (p for p in ("/usr/local/cuda/bin/nvcc",) if os.access(p, os.X_OK)), None)


def _cache_dir() -> Path:
    base = env.CUBIN_CACHE.read() or os.path.join(env.cache_home(), "andrea", "cubin")
    path = Path(base)
    path.mkdir(parents=True, exist_ok=True)
    return path


def compile_kernels(precision: str, arch: str) -> list[Path]:
    """Compile every kernels/*.cu for `arch` (e.g. "sm_90"); returns the cubin paths (cached)."""
    nvcc = nvcc_path()
    if nvcc is None:
        raise RunError("nvcc not found: the CUDA backend compiles its kernels at start")
    header = b"".join(h.read_bytes() for h in sorted(KERNEL_DIR.glob("*.cuh")))  # included
    flags = [f"-arch={arch}", "-std=c++17", "-O3", f"-DANDREA_ACT={ACT_CODE[precision]}"]
    jobs, outs = [], []
    for src in sorted(KERNEL_DIR.glob("*.cu")):
        key = hashlib.sha256(src.read_bytes() + header + " ".join(flags).encode()).hexdigest()[:16]
        out = _cache_dir() / f"{src.stem}-{precision}-{arch}-{key}.cubin"
        outs.append(out)
        if not out.exists():
            tmp = Path(tempfile.mkstemp(suffix=".cubin", dir=out.parent)[1])
            cmd = [nvcc, *flags, "--cubin", "-o", str(tmp), str(src)]
            jobs.append((subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True), tmp, out, src))
    for proc, tmp, out, src in jobs:  # in parallel: nvcc is single-threaded
        _, err = proc.communicate()
        if proc.returncode != 0:
            raise RunError(f"nvcc failed on {src.name}:\n{err}")
        os.replace(tmp, out)
    return outs


class Gpu:
    """The process's primary context, its stream, and kernel modules per precision."""

    _instance: Gpu | None = None

    def __init__(self) -> None:
        import pycuda.driver as drv

        drv.init()
        if drv.Device.count() < 1:
            raise RunError("no CUDA device found")
        self.drv = drv
        self.ordinal = env.CUDA_DEVICE.read()  # the device's number
        self.dev = drv.Device(self.ordinal)
        self.ctx = self.dev.retain_primary_context()
        self.ctx.push()
        atexit.register(self._close)
        self.stream = drv.Stream(flags=1)  # CU_STREAM_NON_BLOCKING: capturable
        # (least, greatest) stream priority; the main stream runs at the greatest, a backend's
        # weight-gradient stream below it (CudaBuild._set_stream_priorities)
        self.stream_priorities = graphs.stream_priority_range()
        graphs.set_stream_priority(self.stream.handle, self.stream_priorities[1])
        major, minor = self.dev.compute_capability()
        self.arch = f"sm_{major}{minor}"
        self.total_mem = self.dev.total_memory()
        self._kernels: dict[str, dict[str, Any]] = {}
        self._cubins: dict[str, list[Path]] = {}
        self._modules: list[Any] = []

    @classmethod
    def get(cls) -> Gpu:
        if cls._instance is None:
            cls._instance = Gpu()
        return cls._instance

    def _close(self) -> None:
        import gc

        gc.collect()  # free allocations (and cuBLAS handles) before the context goes
        try:
            self.ctx.pop()
        except Exception:
            pass

    def describe(self, precision: str) -> str:
        major, minor = self.dev.compute_capability()
        return (f"{self.dev.name()} (sm_{major}{minor}, {self.total_mem / 2**30:.0f} GiB, "
                f"{precision})")

    def kernels(self, precision: str) -> dict[str, Any]:
        """name -> prepared PyCUDA function, for one activation precision."""
        if precision not in self._kernels:
            funcs: dict[str, Any] = {}
            self._cubins[precision] = compile_kernels(precision, self.arch)
            for cubin in self._cubins[precision]:
                module = self.drv.module_from_file(str(cubin))
                self._modules.append(module)
                for name, sig in SIGNATURES.items():
                    try:
                        f = module.get_function(name)
                    except self.drv.LogicError:
                        continue
                    f.prepare(sig)
                    funcs[name] = f
            missing = set(SIGNATURES) - set(funcs)
            if missing:
                raise RunError(f"kernels missing from the modules: {sorted(missing)}")
            self._kernels[precision] = funcs
        return self._kernels[precision]

    def cubin(self, precision: str, source: str) -> Path:
        """The compiled cubin of kernels/<source>.cu for a precision (for the driver API's own
        module loads: graphs.py's fill kernel)."""
        self.kernels(precision)
        for path in self._cubins[precision]:
            if path.name.startswith(f"{source}-"):
                return path
        raise RunError(f"no kernels/{source}.cu among the compiled kernels")
