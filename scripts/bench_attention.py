#!/usr/bin/env python3
"""Attention at ANDREA-120M's shape (B=8, H=12, T=1024, hd=64, causal, bf16) on one H200: cuDNN's
SDPA graphs (the engine's path: forward, deterministic and default backward) against the CuTe DSL
flex attention that nvidia-cudnn-frontend 1.32 ships for SM90 (forward, deterministic and default
backward). Not part of the engine: it measures whether the frontend's own kernels would pay.

For each: the time per call (a CUDA graph of N calls, median of 5 replays; eager back to back
where capture fails), the backward's bits over 3 runs, and the max |diff| of o, dq, dk, dv
against float32 math attention. Prints a line each and one JSON line at the end.
Env: PROBE_B, PROBE_H, PROBE_T, PROBE_D (the shape), PROBE_N (20 calls a graph), FLEX_SITE
(the --target directory the wheels went into, /tmp/site2).

Needs PyTorch (the flex API takes torch tensors), the frontend wheel and the CuTe DSL runtime
(nvidia-cutlass-dsl 4.8.1 with -libs-base, -libs-core and -libs-cu13, apache-tvm-ffi, protobuf,
cuda-bindings), all --no-deps into FLEX_SITE. nvidia-cutlass-dsl-libs-cu13 is a 92 MB wheel,
more than one device call may carry: engine/backends/cuda/NOTES.md ("twelfth session") says how
it was carried in two parts.
"""
import json
import math
import os
import site
import statistics
import sys
import traceback

site.addsitedir(os.environ.get("FLEX_SITE", "/tmp/site2"))  # its .pth adds cutlass's packages

import torch
import torch.nn.functional as F

B, H, T, D = (int(os.environ.get(f"PROBE_{k}", v)) for k, v in (("B", 8), ("H", 12), ("T", 1024), ("D", 64)))
N = int(os.environ.get("PROBE_N", 20))
dev = torch.device("cuda")
res: dict = {"shape": dict(B=B, H=H, T=T, D=D)}


def say(*a):
    print(*a, flush=True)


def timed(name, fn, stream):
    """median over 5 replays of N calls, µs per call; graph capture first, eager if it fails."""
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    mode, run = "graph", None
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=stream):
            for _ in range(N):
                fn()
        run = g.replay
    except Exception as e:
        mode = f"eager ({type(e).__name__}: {str(e)[:120]})"
        torch.cuda.synchronize()

        def run():
            for _ in range(N):
                fn()
    ts = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            a.record(stream)
            run()
            b.record(stream)
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) * 1000 / N)
    us = statistics.median(ts)
    say(f"{name}: {us:.1f} us/call ({mode}; rounds {', '.join(f'{t:.1f}' for t in ts)})")
    res[name] = {"us": us, "mode": mode}
    return us


torch.manual_seed(0)
q, k, v, do = (torch.randn(B, T, H, D, device=dev, dtype=torch.bfloat16) for _ in range(4))
scale = 1.0 / math.sqrt(D)

# float32 math reference (BSHD -> BHSD)
def reference():
    qf, kf, vf = (x.float().transpose(1, 2).requires_grad_(True) for x in (q, k, v))
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        o = F.scaled_dot_product_attention(qf, kf, vf, is_causal=True, scale=scale)
    o.backward(do.float().transpose(1, 2))
    return [x.transpose(1, 2) for x in (o.detach(), qf.grad, kf.grad, vf.grad)]


torch.backends.cuda.matmul.allow_tf32 = False
ref = reference()
torch.cuda.synchronize()


def errs(name, got):
    e = {n: float((g.float() - r).abs().max()) for n, g, r in zip(("o", "dq", "dk", "dv"), got, ref, strict=True)}
    say(f"{name} max|diff| vs fp32: " + ", ".join(f"{n} {x:.2e}" for n, x in e.items()))
    res[name + " err"] = e


stream = torch.cuda.Stream()

# --- cuDNN's SDPA graphs (the engine's path), BSHD strides -------------------------------------
try:
    from cuda.pathfinder import load_nvidia_dynamic_lib
    load_nvidia_dynamic_lib("nvrtc")
except Exception:
    pass
import cudnn  # noqa: E402

res["cudnn"] = f"{cudnn.backend_version()} frontend {cudnn.__version__}"
say("cudnn", res["cudnn"], "torch", torch.__version__)
handle = cudnn.create_handle()
cudnn.set_stream(handle, stream.cuda_stream)
dims, st = [B, H, T, D], [T * H * D, D, H * D, 1]
sd, ss = [B, H, T, 1], [H * T, T, 1, 1]
BF, F32 = cudnn.data_type.BFLOAT16, cudnn.data_type.FLOAT
mask = dict(diagonal_alignment=cudnn.diagonal_alignment.TOP_LEFT, diagonal_band_right_bound=0)


def new_graph():
    return cudnn.pygraph(io_data_type=BF, intermediate_data_type=F32, compute_data_type=F32,
                         handle=handle, is_cuda_graph_replay_expected=True)


def finish(g):
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans()
    return g


o_c = torch.empty_like(q)
lse_c = torch.empty(B, H, T, 1, device=dev, dtype=torch.float32)
gf = new_graph()
tq, tk, tv = (gf.tensor(name=n, dim=dims, stride=st, data_type=BF) for n in "qkv")
to, tst = gf.sdpa(name="sdpa", q=tq, k=tk, v=tv, generate_stats=True, attn_scale=scale, **mask)
to.set_output(True).set_dim(dims).set_stride(st).set_data_type(BF)
tst.set_output(True).set_dim(sd).set_stride(ss).set_data_type(F32)
finish(gf)
wsf = torch.empty(max(1, gf.get_workspace_size()), device=dev, dtype=torch.uint8)
packf = {tq: q.data_ptr(), tk: k.data_ptr(), tv: v.data_ptr(), to: o_c.data_ptr(), tst: lse_c.data_ptr()}
cfwd = lambda: gf.execute(packf, wsf.data_ptr(), handle=handle)  # noqa: E731
with torch.cuda.stream(stream):
    cfwd()
torch.cuda.synchronize()

cudnn_bwd = {}
for det in (True, False):
    gb = new_graph()
    bq, bk, bv = (gb.tensor(name=n, dim=dims, stride=st, data_type=BF) for n in "qkv")
    bo, bdo = (gb.tensor(name=n, dim=dims, stride=st, data_type=BF) for n in ("o", "do"))
    bst = gb.tensor(name="stats", dim=sd, stride=ss, data_type=F32)
    bdq, bdk, bdv = gb.sdpa_backward(name="bwd", q=bq, k=bk, v=bv, o=bo, dO=bdo, stats=bst,
                                     attn_scale=scale, use_deterministic_algorithm=det, **mask)
    for t in (bdq, bdk, bdv):
        t.set_output(True).set_dim(dims).set_stride(st).set_data_type(BF)
    finish(gb)
    outs = [torch.empty_like(q) for _ in range(3)]
    wsb = torch.empty(max(1, gb.get_workspace_size()), device=dev, dtype=torch.uint8)
    pack = {bq: q.data_ptr(), bk: k.data_ptr(), bv: v.data_ptr(), bo: o_c.data_ptr(),
            bdo: do.data_ptr(), bst: lse_c.data_ptr(), bdq: outs[0].data_ptr(),
            bdk: outs[1].data_ptr(), bdv: outs[2].data_ptr()}
    cudnn_bwd[det] = (gb, pack, wsb, outs)

with torch.cuda.stream(stream):
    cfwd()
torch.cuda.synchronize()
for det in (True, False):
    gb, pack, wsb, outs = cudnn_bwd[det]
    runs = []
    for _ in range(3):
        with torch.cuda.stream(stream):
            gb.execute(pack, wsb.data_ptr(), handle=handle)
        torch.cuda.synchronize()
        runs.append([x.clone() for x in outs])
    same = all(torch.equal(a, b) for r in runs[1:] for a, b in zip(runs[0], r, strict=True))
    tag = "cudnn bwd " + ("det" if det else "default")
    say(f"{tag}: bits over 3 runs {'identical' if same else 'DIFFER'}; workspace {wsb.numel() / 2**20:.1f} MiB")
    res[tag + " same bits"] = same
    errs(tag, [o_c] + runs[0])
timed("cudnn fwd", cfwd, stream)
for det in (True, False):
    gb, pack, wsb, outs = cudnn_bwd[det]
    timed("cudnn bwd " + ("det" if det else "default"),
          lambda gb=gb, pack=pack, wsb=wsb: gb.execute(pack, wsb.data_ptr(), handle=handle), stream)

# --- flex attention (CuTe DSL) -------------------------------------------------------------------
try:
    from cudnn.flex_attention import create_mask_plan
    from cudnn.flex_attention.execution import FlexAttentionBwd, FlexAttentionFwd

    mf = torch.arange(1, T + 1, device=dev, dtype=torch.int32).repeat(B).reshape(1, 1, B * T).contiguous()
    qg, kg, vg = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    plan = create_mask_plan(mf, qg, kg, vg, build_backward=True)
    o_f = torch.empty_like(q)
    lse_f = torch.empty(B, H, T, device=dev, dtype=torch.float32)
    fa = FlexAttentionFwd(q, k, v, o_f, plan, lse_f)
    fa.check_support()
    fa.compile()
    wsff = torch.empty(max(1, fa.workspace_size), device=dev, dtype=torch.uint8) if fa.workspace_size else None
    ffwd = lambda: fa.execute(q, k, v, o_f, plan, lse_f, workspace=wsff, softmax_scale=scale,  # noqa: E731
                              current_stream=torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ffwd()
    torch.cuda.synchronize()
    say("flex fwd: o vs cudnn max|diff|", float((o_f.float() - o_c.float()).abs().max()),
        "lse vs cudnn", float((lse_f - lse_c[..., 0]).abs().max()))
    for det in (True, False):
        outs = [torch.empty_like(q) for _ in range(3)]
        fb = FlexAttentionBwd(q, k, v, o_f, do, lse_f, *outs, plan, None, deterministic=det)
        fb.check_support()
        fb.compile()
        wsfb = torch.empty(max(1, fb.workspace_size), device=dev, dtype=torch.uint8)
        fn = (lambda fb=fb, outs=outs, wsfb=wsfb: fb.execute(  # noqa: E731
            q, k, v, o_f, do, lse_f, *outs, plan, None, workspace=wsfb, softmax_scale=scale,
            current_stream=torch.cuda.current_stream()))
        runs = []
        for _ in range(3):
            with torch.cuda.stream(stream):
                fn()
            torch.cuda.synchronize()
            runs.append([x.clone() for x in outs])
        same = all(torch.equal(a, b) for r in runs[1:] for a, b in zip(runs[0], r, strict=True))
        tag = "flex bwd " + ("det" if det else "default")
        say(f"{tag}: bits over 3 runs {'identical' if same else 'DIFFER'}; workspace {wsfb.numel() / 2**20:.1f} MiB")
        res[tag + " same bits"] = same
        errs(tag, [o_f] + runs[0])
        timed(tag, fn, stream)
    timed("flex fwd", ffwd, stream)
except Exception:
    traceback.print_exc()
    res["flex error"] = traceback.format_exc()[-600:]

print(json.dumps(res))
sys.stdout.flush()
