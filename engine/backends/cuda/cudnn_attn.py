"""Causal attention through cuDNN's fused flash attention (SDPA forward and backward), on the
engine's own device pointers and stream, through nvidia-cudnn-frontend's Python graph API (no
PyTorch). The optional extra `andrea[cudnn]` installs it; without it, or where cuDNN refuses a
shape, the backend runs its own attention (ops.attn_fwd / attn_bwd) and says which one runs.

What the numpy twin computes (ops.attn_fwd / attn_bwd: S = QKᵀ/sqrt(hd), causal softmax, PV and
its backward) in one fused kernel per direction, without the [B,H,T,T] probabilities: the
forward saves the per-row log-sum-exp `stats` (float32 [B,H,T]) instead, and the backward
recomputes P from it. The backward is cuDNN's deterministic one (`use_deterministic_algorithm`:
the default is not bitwise repeatable), so the same inputs give the same bits.

Layout, as everywhere on the GPU: time-major rows (r = t·B + b), heads side by side; Q, K and V
are slabs of [R_max, d] (`slab` elements apart). cuDNN reads them in place through strides:
dims [B, H, T, hd], strides [d, hd, B·d, 1]. No permutes. With `rows` Q, K and V stand side by
side in each row instead, as one [R_max, 3d] matrix (strides [3d, hd, B·3d, 1], K and V d and
2d elements after Q), and so do dQ, dK and dV in the backward: the layout in which Q, K, V are
one GEMM with N = 3d (ops.attn_qkv_fwd_rows) and their input gradient one over K = 3d
(ops.attn_qkv_bwd_rows). O and dO are [R_max, d] either way.

Graphs are built once per (B, T, direction) at start (build() runs cuDNN's heuristics and its
run-time compilation), run once eagerly before a CUDA graph captures them (their first run does
host set-up that must not happen under capture), and their largest workspace is part of the
memory plan. Shorter sequences (T < the built T) run the full-length graph: the attention is
causal, so rows t < T never see rows t >= T in the forward; in the backward the rows t >= T of
dO are zeroed first (the backend does it), so they add nothing to dK, dV of the rows t < T.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from engine import env
from engine.errors import RunError


def cudnn_available() -> tuple[bool, str]:
    """(importable, why not) for the cuDNN frontend; never raises, never imports torch."""
    if not env.CUDNN.read():
        return False, f"{env.CUDNN.name}=0"
    try:
        import cudnn  # noqa: F401
    except Exception as e:  # ImportError, or a library it cannot load
        return False, f"nvidia-cudnn-frontend is not usable ({type(e).__name__}: {e})"
    return True, ""


def sdpa_strides(B: int, head_dim: int, row: int) -> list[int]:
    """cuDNN's strides (elements) for the dims [B, H, T, hd] of a time-major tensor whose rows
    (r = t·B + b) are `row` elements apart, heads side by side in a row: d for a slab, 3d for
    Q, K, V (or dQ, dK, dV) side by side."""
    return [row, head_dim, B * row, 1]


@dataclass
class _Graph:
    graph: Any
    tensors: dict[str, Any]  # name -> the graph's tensor object
    workspace: int


class CudnnAttention:
    """SDPA forward and (deterministic) backward graphs for one compute precision, on one
    stream. `fwd` and `bwd` take raw device pointers (ints)."""

    def __init__(self, precision: str, n_head: int, head_dim: int, stream_handle: int,
                 rows: bool = False) -> None:
        try:  # cuDNN's run-time compiled engines load libnvrtc by soname: have one loaded
            from cuda.pathfinder import load_nvidia_dynamic_lib

            load_nvidia_dynamic_lib("nvrtc")
        except Exception:
            pass  # the system's libnvrtc, if any, is found by the loader instead
        import cudnn

        if precision not in ("bf16", "fp16"):
            raise RunError(f"cuDNN attention computes in bf16 or fp16, not {precision}")
        self.cudnn = cudnn
        self.io = cudnn.data_type.BFLOAT16 if precision == "bf16" else cudnn.data_type.HALF
        self.H, self.hd = n_head, head_dim
        self.rows = rows  # Q, K, V and dQ, dK, dV side by side in rows (module doc)
        self.scale = 1.0 / math.sqrt(head_dim)
        self.handle = cudnn.create_handle()
        cudnn.set_stream(self.handle, stream_handle)
        self.version = f"cuDNN {cudnn.backend_version()} (frontend {cudnn.__version__})"
        self._graphs: dict[tuple[str, int, int], _Graph] = {}

    # --- building --------------------------------------------------------------------------------
    def _dims(self, B: int, T: int
              ) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
        """dims [B,H,T,hd]; the strides of O and dO (a slab); of Q, K, V and their gradients
        (rows 3d apart with `rows`, else a slab); the stats' dims and strides."""
        H, hd = self.H, self.hd
        slab = sdpa_strides(B, hd, H * hd)
        qkv = sdpa_strides(B, hd, 3 * H * hd) if self.rows else slab
        return [B, H, T, hd], slab, qkv, [B, H, T, 1], [H * T, T, 1, 1]

    def _new(self) -> Any:
        c = self.cudnn
        return c.pygraph(io_data_type=self.io, intermediate_data_type=c.data_type.FLOAT,
                         compute_data_type=c.data_type.FLOAT, handle=self.handle,
                         is_cuda_graph_replay_expected=True)

    def _finish(self, g: Any, tensors: dict[str, Any]) -> _Graph:
        c = self.cudnn
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([c.heur_mode.A, c.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        return _Graph(g, tensors, int(g.get_workspace_size()))

    def _mask(self) -> dict[str, Any]:
        return {"diagonal_alignment": self.cudnn.diagonal_alignment.TOP_LEFT,
                "diagonal_band_right_bound": 0}

    def build(self, B: int, T: int, backward: bool) -> int:
        """Build the forward (and backward) graphs for B sequences of T; returns the largest
        workspace in bytes. Raises RunError with cuDNN's reason when it refuses the shape."""
        F32 = self.cudnn.data_type.FLOAT
        dims, strides, qstrides, sdims, sstrides = self._dims(B, T)
        try:
            if ("fwd", B, T) not in self._graphs:
                g = self._new()
                q, k, v = (g.tensor(name=n, dim=dims, stride=qstrides, data_type=self.io)
                           for n in ("q", "k", "v"))
                o, st = g.sdpa(name="sdpa", q=q, k=k, v=v, generate_stats=True,
                               attn_scale=self.scale, **self._mask())
                o.set_output(True).set_dim(dims).set_stride(strides).set_data_type(self.io)
                st.set_output(True).set_dim(sdims).set_stride(sstrides).set_data_type(F32)
                self._graphs[("fwd", B, T)] = self._finish(
                    g, {"q": q, "k": k, "v": v, "o": o, "stats": st})
            if backward and ("bwd", B, T) not in self._graphs:
                g = self._new()
                q, k, v = (g.tensor(name=n, dim=dims, stride=qstrides, data_type=self.io)
                           for n in ("q", "k", "v"))
                o, do = (g.tensor(name=n, dim=dims, stride=strides, data_type=self.io)
                         for n in ("o", "do"))
                st = g.tensor(name="stats", dim=sdims, stride=sstrides, data_type=F32)
                dq, dk, dv = g.sdpa_backward(name="sdpa_bwd", q=q, k=k, v=v, o=o, dO=do,
                                             stats=st, attn_scale=self.scale,
                                             use_deterministic_algorithm=True, **self._mask())
                for t in (dq, dk, dv):
                    t.set_output(True).set_dim(dims).set_stride(qstrides).set_data_type(self.io)
                self._graphs[("bwd", B, T)] = self._finish(
                    g, {"q": q, "k": k, "v": v, "o": o, "do": do, "stats": st, "dq": dq,
                        "dk": dk, "dv": dv})
        except RunError:
            raise
        except Exception as e:  # cuDNN's own exceptions: not supported, no engine, ...
            layout = " with Q, K, V in rows" if self.rows else ""
            why = str(e).splitlines()[0] if str(e) else ""
            raise RunError(f"cuDNN refuses attention B={B} T={T} H={self.H} hd={self.hd}"
                           f"{layout}: {type(e).__name__}: {why}") from None
        return self.workspace_bytes()

    def workspace_bytes(self, B: int | None = None, T: int | None = None) -> int:
        """The largest workspace of the graphs built (for B, T only, when given)."""
        return max((g.workspace for (_, b, t), g in self._graphs.items()
                    if B is None or (b, t) == (B, T)), default=0)

    # --- running ---------------------------------------------------------------------------------
    def _execute(self, key: tuple[str, int, int], ptrs: dict[str, int], ws: int) -> None:
        gr = self._graphs[key]
        pack = {gr.tensors[n]: p for n, p in ptrs.items()}
        try:
            gr.graph.execute(pack, ws, handle=self.handle)
        except Exception as e:
            raise RunError(f"cuDNN attention ({key[0]}, B={key[1]} T={key[2]}) failed: "
                           f"{type(e).__name__}: {e}") from None

    def fwd(self, q: int, k: int, v: int, o: int, stats: int, B: int, T: int, ws: int) -> None:
        """o = softmax(causal(Q Kᵀ/sqrt(hd))) V; stats = the rows' log-sum-exp (float32).
        ws: a device workspace of workspace_bytes(B, T) bytes."""
        self._execute(("fwd", B, T), {"q": q, "k": k, "v": v, "o": o, "stats": stats}, ws)

    def bwd(self, q: int, k: int, v: int, o: int, do: int, stats: int, dq: int, dk: int,
            dv: int, B: int, T: int, ws: int) -> None:
        """dQ, dK, dV (overwritten) from dO and the forward's o and stats."""
        self._execute(("bwd", B, T), {"q": q, "k": k, "v": v, "o": o, "do": do,
                                      "stats": stats, "dq": dq, "dk": dk, "dv": dv}, ws)

    def close(self) -> None:
        self._graphs.clear()
        if self.handle is not None:
            try:
                self.cudnn.destroy_handle(self.handle)
            except Exception:
                pass
            self.handle = None
