#!/usr/bin/env python3
"""Attention at the step's shapes (B=8, T=1024, hd=64, causal, bf16; H=12 for ANDREA-120M, 6 for
ANDREA-12M) on one H200: cuDNN's SDPA graphs (the engine's path: forward, deterministic and
default backward) against the CuTe DSL flex attention that nvidia-cudnn-frontend 1.32 ships for
SM90 (forward, deterministic and default backward). Not part of the engine: it measures whether
the frontend's own kernels would pay.

Layouts: `bshd` (contiguous [B, T, H, hd] tensors) and `engine` (the CUDA backend's: rows t·B + b,
Q, K, V side by side in rows of 3·H·hd, O and dO in rows of H·hd, as strided [B, T, H, hd] views);
in `engine` the flex backward reads cuDNN's forward output and log-sum-exp, as the engine would.

For each: the time per call (a CUDA graph of N calls, median of 5 replays; eager back to back
where capture fails), the backward's bits over 3 runs, the max |diff| of o, dq, dk, dv against
float32 math attention and of flex's dq, dk, dv against cuDNN's deterministic ones. Prints a line
each, a table, and one JSON line at the end.
Env: PROBE_HEADS (12,6), PROBE_LAYOUTS (bshd,engine), PROBE_B, PROBE_T, PROBE_D, PROBE_N (20
calls a graph), FLEX_SITE (the --target directory the wheels went into, /tmp/site2).

Needs PyTorch (the flex API takes torch tensors), the frontend wheel and the CuTe DSL runtime
(nvidia-cutlass-dsl 4.8.1 with -libs-base, -libs-core and -libs-cu13, apache-tvm-ffi, protobuf,
cuda-bindings), all --no-deps into FLEX_SITE. nvidia-cutlass-dsl-libs-cu13 is a 92 MB wheel:
where a GPU machine takes less at a time, carry it in parts (split, then cat) and install it
there.
"""
import json
import math
import os
import site
import statistics
import sys
import traceback
from collections.abc import Callable
from typing import NoReturn


def fail(message: str) -> NoReturn:
    print(f"bench_attention.py: {message}", file=sys.stderr)
    sys.exit(2)


def env_ints(name: str, default: str) -> list[int]:
    """A comma-separated list of positive integers from the environment, or exit status 2."""
    raw = os.environ.get(name, default)
    try:
        values = [int(x) for x in raw.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        fail(f"{name}={raw!r}: expected positive integers separated by commas")
    return values


def env_int(name: str, default: str) -> int:
    values = env_ints(name, default)
    if len(values) != 1:
        fail(f"{name}={os.environ[name]!r}: expected one positive integer")
    return values[0]


B, T, D, N = (env_int(f"PROBE_{k}", v) for k, v in
              (("B", "8"), ("T", "1024"), ("D", "64"), ("N", "20")))
HEADS = env_ints("PROBE_HEADS", "12,6")
LAYOUTS = os.environ.get("PROBE_LAYOUTS", "bshd,engine").split(",")
if not set(LAYOUTS) <= {"bshd", "engine"}:
    fail(f"PROBE_LAYOUTS={','.join(LAYOUTS)!r}: expected bshd and/or engine, comma-separated")
SCALE = 1.0 / math.sqrt(D)

site.addsitedir(os.environ.get("FLEX_SITE", "/tmp/site2"))  # its .pth adds cutlass's packages
try:
    import torch
    import torch.nn.functional as F
except ImportError as e:
    fail(f"needs PyTorch (the flex API takes torch tensors): {e}")
if not torch.cuda.is_available():
    fail("needs a CUDA GPU (torch.cuda.is_available() is False)")
dev = torch.device("cuda")
stream = torch.cuda.Stream()
results: list[dict] = []


def say(*a: object) -> None:
    print(*a, flush=True)


def timed(fn: Callable[[], object]) -> tuple[float, str]:
    """µs per call: median over 5 replays of N calls; graph capture first, eager if it fails."""
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    mode = "graph"
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=stream):
            for _ in range(N):
                fn()
        run: Callable[[], object] = g.replay
    except Exception as e:
        mode = f"eager ({type(e).__name__}: {str(e)[:120]})"
        torch.cuda.synchronize()

        def run() -> None:
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
    return statistics.median(ts), mode


def three_runs(fn: Callable[[], object], outs: list[torch.Tensor]) -> tuple[list[torch.Tensor], bool]:
    """the outputs of the first of 3 runs, and whether all 3 gave the same bits"""
    runs = []
    for _ in range(3):
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.synchronize()
        runs.append([x.clone() for x in outs])
    same = all(torch.equal(a, b) for r in runs[1:] for a, b in zip(runs[0], r, strict=True))
    return runs[0], same


def maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def tensors(H: int, layout: str) -> dict[str, torch.Tensor]:
    """q, k, v, do as [B, T, H, D] (views in the engine's layout), and empty o, dq, dk, dv alike"""
    torch.manual_seed(0)
    if layout == "bshd":
        t = {n: torch.randn(B, T, H, D, device=dev, dtype=torch.bfloat16) for n in ("q", "k", "v", "do")}
        t.update({n: torch.empty(B, T, H, D, device=dev, dtype=torch.bfloat16) for n in ("o", "dq", "dk", "dv")})
        return t
    qkv = torch.randn(T, B, 3, H, D, device=dev, dtype=torch.bfloat16)
    dqkv = torch.empty_like(qkv)
    do = torch.randn(T, B, H, D, device=dev, dtype=torch.bfloat16)
    o = torch.empty_like(do)
    t = {n: qkv[:, :, i].permute(1, 0, 2, 3) for i, n in enumerate(("q", "k", "v"))}
    t.update({"d" + n: dqkv[:, :, i].permute(1, 0, 2, 3) for i, n in enumerate(("q", "k", "v"))})
    t.update(do=do.permute(1, 0, 2, 3), o=o.permute(1, 0, 2, 3))
    return t


def reference(t: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """o, dq, dk, dv in float32 math attention"""
    qf, kf, vf = (t[n].float().transpose(1, 2).requires_grad_(True) for n in ("q", "k", "v"))
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        o = F.scaled_dot_product_attention(qf, kf, vf, is_causal=True, scale=SCALE)
    o.backward(t["do"].float().transpose(1, 2))
    return [x.transpose(1, 2) for x in (o.detach(), qf.grad, kf.grad, vf.grad)]


def bench(H: int, layout: str) -> dict:
    import cudnn
    from cudnn.flex_attention import create_mask_plan
    from cudnn.flex_attention.execution import FlexAttentionBwd, FlexAttentionFwd

    r: dict = {"H": H, "layout": layout}
    tag = f"H={H} {layout}"
    t = tensors(H, layout)
    torch.backends.cuda.matmul.allow_tf32 = False
    ref = reference(t)
    torch.cuda.synchronize()

    # cuDNN's graphs, with each tensor's own strides (dims [B, H, T, D])
    handle = cudnn.create_handle()
    cudnn.set_stream(handle, stream.cuda_stream)
    BF, F32 = cudnn.data_type.BFLOAT16, cudnn.data_type.FLOAT
    mask = dict(diagonal_alignment=cudnn.diagonal_alignment.TOP_LEFT, diagonal_band_right_bound=0)
    dims, sd, ss = [B, H, T, D], [B, H, T, 1], [H * T, T, 1, 1]

    def st(x: torch.Tensor) -> list[int]:
        return [x.stride(0), x.stride(2), x.stride(1), x.stride(3)]

    def graph() -> object:
        return cudnn.pygraph(io_data_type=BF, intermediate_data_type=F32, compute_data_type=F32,
                             handle=handle, is_cuda_graph_replay_expected=True)

    def finish(g: object) -> object:
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        return g

    lse_c = torch.empty(B, H, T, 1, device=dev, dtype=torch.float32)
    gf = graph()
    gq, gk, gv = (gf.tensor(name=n, dim=dims, stride=st(t[n]), data_type=BF) for n in "qkv")
    go, gst = gf.sdpa(name="sdpa", q=gq, k=gk, v=gv, generate_stats=True, attn_scale=SCALE, **mask)
    go.set_output(True).set_dim(dims).set_stride(st(t["o"])).set_data_type(BF)
    gst.set_output(True).set_dim(sd).set_stride(ss).set_data_type(F32)
    finish(gf)
    wsf = torch.empty(max(1, gf.get_workspace_size()), device=dev, dtype=torch.uint8)
    packf = {gq: t["q"].data_ptr(), gk: t["k"].data_ptr(), gv: t["v"].data_ptr(),
             go: t["o"].data_ptr(), gst: lse_c.data_ptr()}

    def cudnn_fwd() -> None:
        gf.execute(packf, wsf.data_ptr(), handle=handle)

    with torch.cuda.stream(stream):
        cudnn_fwd()
    torch.cuda.synchronize()
    o_c = t["o"].clone()
    r["cudnn o err"] = maxdiff(o_c, ref[0])
    r["cudnn fwd us"], _ = timed(cudnn_fwd)
    cudnn_grads = None
    for det in (True, False):
        kind = "det" if det else "default"
        gb = graph()
        bq, bk, bv = (gb.tensor(name=n, dim=dims, stride=st(t[n]), data_type=BF) for n in "qkv")
        bo, bdo = (gb.tensor(name=n, dim=dims, stride=st(t[n]), data_type=BF) for n in ("o", "do"))
        bst = gb.tensor(name="stats", dim=sd, stride=ss, data_type=F32)
        grads = gb.sdpa_backward(name="bwd", q=bq, k=bk, v=bv, o=bo, dO=bdo, stats=bst,
                                 attn_scale=SCALE, use_deterministic_algorithm=det, **mask)
        for g, n in zip(grads, ("dq", "dk", "dv"), strict=True):
            g.set_output(True).set_dim(dims).set_stride(st(t[n])).set_data_type(BF)
        finish(gb)
        wsb = torch.empty(max(1, gb.get_workspace_size()), device=dev, dtype=torch.uint8)
        pack = {bq: t["q"].data_ptr(), bk: t["k"].data_ptr(), bv: t["v"].data_ptr(),
                bo: t["o"].data_ptr(), bdo: t["do"].data_ptr(), bst: lse_c.data_ptr(),
                **{g: t[n].data_ptr() for g, n in zip(grads, ("dq", "dk", "dv"), strict=True)}}

        def cudnn_bwd(gb: object = gb, pack: dict = pack, wsb: torch.Tensor = wsb) -> None:
            gb.execute(pack, wsb.data_ptr(), handle=handle)

        got, same = three_runs(cudnn_bwd, [t["dq"], t["dk"], t["dv"]])
        if det:
            cudnn_grads = got
        r[f"cudnn bwd {kind} same bits"] = same
        r[f"cudnn bwd {kind} err"] = [maxdiff(a, b) for a, b in zip(got, ref[1:], strict=True)]
        r[f"cudnn bwd {kind} workspace MiB"] = wsb.numel() / 2**20
        r[f"cudnn bwd {kind} us"], _ = timed(cudnn_bwd)
        say(f"{tag} cudnn bwd {kind}: {r[f'cudnn bwd {kind} us']:.1f} us, same bits {same}")

    # the frontend's flex attention; in the engine layout its backward reads cuDNN's o and stats
    try:
        mf = torch.arange(1, T + 1, device=dev, dtype=torch.int32).repeat(B).reshape(1, 1, B * T).contiguous()
        plan = create_mask_plan(mf, t["q"], t["k"], t["v"], build_backward=True)
        o_f = torch.empty(B, T, H, D, device=dev, dtype=torch.bfloat16)
        lse_f = torch.empty(B, H, T, device=dev, dtype=torch.float32)
        fa = FlexAttentionFwd(t["q"], t["k"], t["v"], o_f, plan, lse_f)
        fa.check_support()
        fa.compile()
        wsff = torch.empty(fa.workspace_size, device=dev, dtype=torch.uint8) if fa.workspace_size else None

        def flex_fwd() -> None:
            fa.execute(t["q"], t["k"], t["v"], o_f, plan, lse_f, workspace=wsff,
                       softmax_scale=SCALE, current_stream=torch.cuda.current_stream())

        with torch.cuda.stream(stream):
            flex_fwd()
        torch.cuda.synchronize()
        r["flex o err"] = maxdiff(o_f, ref[0])
        r["flex o vs cudnn"] = maxdiff(o_f, o_c)
        r["flex lse vs cudnn"] = maxdiff(lse_f, lse_c[..., 0])
        r["flex fwd us"], r["flex fwd mode"] = timed(flex_fwd)
        o_in, lse_in = (o_f, lse_f) if layout == "bshd" else (t["o"], lse_c[..., 0])
        for det in (True, False):
            kind = "det" if det else "default"
            outs = [t["dq"], t["dk"], t["dv"]]
            fb = FlexAttentionBwd(t["q"], t["k"], t["v"], o_in, t["do"], lse_in, *outs, plan, None,
                                  deterministic=det)
            fb.check_support()
            fb.compile()
            wsfb = torch.empty(max(1, fb.workspace_size), device=dev, dtype=torch.uint8)

            def flex_bwd(fb: object = fb, wsfb: torch.Tensor = wsfb, outs: list = outs) -> None:
                fb.execute(t["q"], t["k"], t["v"], o_in, t["do"], lse_in, *outs, plan, None,
                           workspace=wsfb, softmax_scale=SCALE,
                           current_stream=torch.cuda.current_stream())

            got, same = three_runs(flex_bwd, outs)
            r[f"flex bwd {kind} same bits"] = same
            r[f"flex bwd {kind} err"] = [maxdiff(a, b) for a, b in zip(got, ref[1:], strict=True)]
            r[f"flex bwd {kind} vs cudnn det"] = [maxdiff(a, b) for a, b in
                                                  zip(got, cudnn_grads, strict=True)]
            r[f"flex bwd {kind} workspace MiB"] = wsfb.numel() / 2**20
            r[f"flex bwd {kind} us"], r[f"flex bwd {kind} mode"] = timed(flex_bwd)
            say(f"{tag} flex bwd {kind}: {r[f'flex bwd {kind} us']:.1f} us "
                f"({r[f'flex bwd {kind} mode']}), same bits {same}, "
                f"vs cuDNN det max|diff| {r[f'flex bwd {kind} vs cudnn det']}")
    except Exception:
        traceback.print_exc()
        r["flex error"] = traceback.format_exc()[-600:]
    return r


def main() -> None:
    try:
        import cudnn
    except ImportError as e:
        fail(f"needs nvidia-cudnn-frontend (and for flex the CuTe DSL in FLEX_SITE): {e}")

    say(f"cuDNN {cudnn.backend_version()} frontend {cudnn.__version__}, torch {torch.__version__}, "
        f"B={B} T={T} hd={D}, {N} calls a graph")
    for H in HEADS:
        for layout in LAYOUTS:
            try:
                results.append(bench(H, layout))
            except Exception:
                traceback.print_exc()
                results.append({"H": H, "layout": layout, "error": traceback.format_exc()[-600:]})
    cols = ("cudnn fwd us", "cudnn bwd det us", "cudnn bwd default us", "flex fwd us",
            "flex bwd det us", "flex bwd default us")
    say("\nµs a call (median of 5 replays)")
    say(f"{'H':>3} {'layout':<7}" + "".join(f"{c.removesuffix(' us'):>19}" for c in cols))
    for r in results:
        say(f"{r['H']:>3} {r['layout']:<7}" + "".join(
            f"{r[c]:>19.1f}" if c in r else f"{'-':>19}" for c in cols))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
