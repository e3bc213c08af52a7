"""Which attention a CudaBackend runs, decided once at start (CudaBuild): cuDNN's fused flash
attention or the classic one, Q, K, V in rows or in slabs, and the flex deterministic backward
in place of cuDNN's. Where the GPU or a library refuses what the config's gpu section asks,
what runs instead is chosen here and `notes` says why.

- "cudnn" (cudnn_attn.py: no [B,H,T,T] buffers) or "classic" (Ops.attn_fwd / attn_bwd: chunked
  GEMMs and a softmax kernel). gpu.attention "auto" takes cuDNN when the frontend is installed,
  the precision is bf16/fp16 and cuDNN accepts the shapes; else classic, with the reason.
- Q, K, V in rows ([R,3d], gpu.qkv_rows; cuDNN and fusions only): one GEMM with N = 3d computes
  them, cuDNN reads them and writes dQ, dK, dV so, and their input gradient is one GEMM over
  K = 3d, instead of slabs and three GEMMs each way. The GEMM copy of the weights (params_lp)
  then keeps each layer's W_Q, W_K, W_V as one [d,3d] W_QKV in their 3d² range (kernels/optim.cu
  lp_index, buffers.lp_positions); the float32 masters, gradients, m and v, and so the
  checkpoint, keep the flat layout of DESIGN §2. It changes the bits (the input gradient's sum
  rounded once instead of three times). d² < 2³¹: the optimizer kernels' 32-bit division
  (buffers.qkv_seg_table). The layout cuDNN's graphs were built for decides, before the GEMM
  copy is first written: the GEMMs and the GEMM copy follow it.
- the flex backward (gpu.flex_backward, flex_attn.py) changes the bits; where it cannot run,
  cuDNN's does.
"""

from __future__ import annotations

from typing import Any

from engine.backends.cuda import flex_attn
from engine.errors import RunError, UserError
from engine.model.layout import ModelShapes


class AttentionChoice:
    """The attention path of one backend: `attention` ("cudnn" | "classic"), `info` (what runs
    and why), `cudnn` (a cudnn_attn.CudnnAttention with its graphs built, or None), `qkv_rows`
    and `flex` (a flex_attn.FlexAttention, or None). Refusals are appended to `notes`."""

    def __init__(self, shapes: ModelShapes, micro_batch: int, precision: str, fusions: bool,
                 qkv_rows_wanted: bool, gpu: Any, stream: Any, notes: list[str]) -> None:
        self.shapes, self.B, self.S = shapes, micro_batch, shapes.seq_len
        self.precision, self.fusions = precision, fusions
        self.gpu, self.stream, self.notes = gpu, stream, notes
        self.want_qkv_rows = fusions and shapes.d_model ** 2 < 2**31 and qkv_rows_wanted
        self.cudnn: Any = None
        self.attention, self.info = "classic", ""
        self.qkv_rows = False
        self.flex: flex_attn.FlexAttention | None = None

    def choose(self, want: str, flex_backward: bool) -> None:
        """Decide everything but the flex backward's binding (`bind_flex`, once the memory
        plan is allocated)."""
        self.attention, self.info = self._pick_attention(want)
        self.qkv_rows = self.attention == "cudnn" and self.cudnn.rows
        self.flex = self.pick_flex() if flex_backward else None

    def workspace_bytes(self) -> int:
        """cuDNN's workspace for the training and the sampling graphs (0 without cuDNN)."""
        if self.cudnn is None:
            return 0
        return max(self.cudnn.workspace_bytes(self.B, self.S),
                   self.cudnn.workspace_bytes(1, self.S))

    def _pick_attention(self, want: str) -> tuple[str, str]:
        """("cudnn" | "classic", what runs and why), building cuDNN's graphs when it is used:
        with Q, K, V and dQ, dK, dV side by side in rows when gpu.qkv_rows wants it, else (or
        where cuDNN refuses any of those graphs, with a note) as slabs."""
        if want == "classic":
            return "classic", "classic (requested)"
        why = ""
        if self.precision == "fp32":
            why = "fp32 precision keeps the classic attention"
        else:
            from engine.backends.cuda.cudnn_attn import CudnnAttention, cudnn_available

            ok, why = cudnn_available()
            # Q, K, V in rows first when wanted; where cuDNN refuses one of those graphs (the
            # training forward, its backward, the sampling forward), the slabs
            layouts = (True, False) if self.want_qkv_rows else (False,)
            for rows in layouts if ok else ():
                s = self.shapes
                try:
                    # this backend's own graphs and handle: a cuDNN graph captured into a CUDA
                    # graph after it ran on another backend's buffers used those (freed) buffers
                    # (seen on the H200: wrong values, then an illegal address), so graphs are
                    # never shared
                    att = CudnnAttention(self.precision, s.n_head, s.d_model // s.n_head,
                                         self.stream.handle, rows=rows)
                    self.cudnn = att
                    att.build(self.B, self.S, backward=True)
                    att.build(1, self.S, backward=False)  # sampling (logits_last)
                    if self.want_qkv_rows and not rows:
                        self.notes.append(f"gpu.qkv_rows: cuDNN refuses Q, K, V in rows "
                                          f"({why}); the slabs and three GEMMs run instead")
                    return "cudnn", f"cudnn ({att.version}; deterministic backward)"
                except RunError as e:
                    why = str(e)
                except Exception as e:  # a frontend that imports but cannot start
                    why = f"cuDNN did not start: {type(e).__name__}: {e}"
                if self.cudnn is not None:
                    self.cudnn.close()
                    self.cudnn = None
        if want == "cudnn":
            raise UserError(f"gpu.attention cudnn: {why}")
        return "classic", f"classic ({why})"

    def pick_flex(self) -> flex_attn.FlexAttention | None:
        """The flex deterministic backward (gpu.flex_backward) where it can run
        (flex_attn.refusal, then its library loads), with `info` saying so; else None,
        cuDNN's backward runs and a note says why."""
        s = self.shapes
        hd = s.d_model // s.n_head
        why = flex_attn.refusal(self.attention, self.qkv_rows, self.precision, hd, self.S,
                                self.gpu.dev.compute_capability(), rows_off=self.rows_off())
        if why:
            self._flex_off(why)
            return None
        try:
            # the one shape the backward runs at: the micro-batch at full length
            fb = flex_attn.open_backward(self.B, self.S, s.n_head, self.gpu.ordinal)
        except (RunError, UserError) as e:
            self._flex_off(str(e))
            return None
        finally:  # a build's note, whether or not its library then loads
            self.notes.extend(flex_attn.build_notes)
            flex_attn.build_notes.clear()
        self.info = f"cudnn ({self.cudnn.version}; flex deterministic backward)"
        return flex_attn.FlexAttention(fb, self.cudnn.scale)  # cuDNN's forward's

    def rows_off(self) -> str:
        """Why Q, K, V are not in rows (`qkv_rows` false; "" where they are): fusions off,
        d² ≥ 2³¹, gpu.qkv_rows false, or cuDNN refusing the rows (its note says why)."""
        if self.qkv_rows:
            return ""
        if not self.fusions:
            return "the rows are the fused path's, and gpu.fusions is false"
        if self.shapes.d_model ** 2 >= 2**31:
            return "d_model² ≥ 2³¹: the optimizer kernels' 32-bit division keeps the slabs"
        if not self.want_qkv_rows:
            return "gpu.qkv_rows is false"
        if self.attention != "cudnn":
            return f"the {self.attention} attention runs"
        return "cuDNN refuses them in rows: see the gpu.qkv_rows note"

    def _flex_off(self, why: str) -> None:
        """The flex backward refused (`why`): a note saying why and what runs instead."""
        then = ("cuDNN's deterministic backward runs" if self.attention == "cudnn"
                else "it is not used")
        self.notes.append(f"gpu.flex_backward: {why}; {then}")

    def bind_flex(self, plan: Any, drv: Any, ops: Any, train: Any) -> None:
        """Once the plan is allocated and zeroed: the flex backward's plan arrays uploaded, then
        its first call (which loads its cubin), eager, on layer 0's training buffers (`train`,
        a BatchBuffers; zeros: finite), before any graph is captured; then `ops` runs it. Where
        either fails with a RunError: cuDNN's deterministic backward, as `pick_flex` refuses,
        with `info` back to cuDNN's. Only a fault the call reports is caught: one that kills
        the context (an illegal address) is a RunError that says so, and a kernel that never
        ends is not caught."""
        assert self.flex is not None
        a = train.layer(0)
        step = "its plan did not upload"
        try:
            self.flex.bind(plan, drv)
            step = "its first call failed"
            self.flex.bwd(dout=train.at("datt"), qkv=a["qkv"], out=a["att"],
                          stats=a["attn_stats"], dqkv=train.at("dqkv"), B=self.B, T=self.S,
                          stream=self.stream.handle)
        except RunError as e:
            self.flex = ops.flex = None
            self.info = f"cudnn ({self.cudnn.version}; deterministic backward)"
            self._flex_off(f"{step}: {e}")
            return
        try:
            self.stream.synchronize()
        except Exception as e:  # pycuda's own error: a fault the context does not survive
            raise RunError(f"gpu.flex_backward: its first call faulted ({type(e).__name__}: "
                           f"{e}); the CUDA context is lost: start with \"flex_backward\": "
                           f"false in the config's gpu section") from None
        ops.flex = self.flex
