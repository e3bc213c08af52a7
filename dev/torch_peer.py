"""dev/bench_gpu.py's PyTorch peer: the engine's model (DESIGN §2) in PyTorch at its best
practice (bf16 autocast, fused AdamW, flash SDPA, TF32 on, clip_grad_norm_, Q/K/V from one
Linear as nanoGPT's c_attn), its step in each variant a name gives, and its device clock.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_timing import STEP_HP, Clock

from engine.model.layout import ModelShapes, init_params, n_params, tensor_table

QKV = ("attn.W_Q", "attn.W_K", "attn.W_V")
TORCH_MODES = ("eager", "compile", "reduce-overhead", "max-autotune")
# a PyTorch variant is a mode and any of these suffixes, in this order (torch_variant parses it)
SEPARATE_QKV = "-sepqkv"  # Q, K, V as three Linears (not best practice)
CUDNN_SDPA = "-cudnn"  # scaled_dot_product_attention through cuDNN's attention, not its default
SYNC = "-sync"  # the host waits for each step (reads its loss before queueing the next)


@dataclass(frozen=True)
class TorchVariant:
    mode: str
    fused_qkv: bool = True
    cudnn_sdpa: bool = False
    sync: bool = False


def torch_variant(name: str) -> TorchVariant:
    """`mode[-sepqkv][-cudnn][-sync]`, e.g. reduce-overhead-cudnn; ValueError for anything else
    (a misspelt variant must fail, not run as another one under its name)."""
    rest, flags = name, {}
    for suffix, key in ((SYNC, "sync"), (CUDNN_SDPA, "cudnn_sdpa"), (SEPARATE_QKV, "sepqkv")):
        flags[key] = rest.endswith(suffix)
        rest = rest.removesuffix(suffix)
    if rest not in TORCH_MODES:
        raise ValueError(f"PyTorch variant {name!r}: expected one of {', '.join(TORCH_MODES)}, "
                         f"then optionally {SEPARATE_QKV}, {CUDNN_SDPA}, {SYNC} in that order")
    return TorchVariant(rest, not flags["sepqkv"], flags["cudnn_sdpa"], flags["sync"])


def torch_model(s: ModelShapes, fused_qkv: bool = True, cudnn_sdpa: bool = False):
    """The engine's model in PyTorch; fused_qkv: Q, K and V from one Linear (nanoGPT's c_attn,
    the faster), else three; cudnn_sdpa: scaled_dot_product_attention through cuDNN's fused
    attention (torch.nn.attention.sdpa_kernel) instead of the backend PyTorch picks itself."""
    import contextlib

    import torch
    import torch.nn.functional as F
    from torch import nn

    def attention_backend() -> Any:
        if not cudnn_sdpa:
            return contextlib.nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel([SDPBackend.CUDNN_ATTENTION])

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            d = s.d_model
            self.ln1, self.ln2 = nn.LayerNorm(d, eps=1e-5), nn.LayerNorm(d, eps=1e-5)
            if fused_qkv:  # nanoGPT's c_attn: one GEMM for Q, K and V
                self.qkv = nn.Linear(d, 3 * d, bias=False)
            else:
                self.q, self.k, self.v = (nn.Linear(d, d, bias=False) for _ in range(3))
            self.o = nn.Linear(d, d, bias=False)
            self.w1, self.w2 = nn.Linear(d, s.d_ff, bias=False), nn.Linear(s.d_ff, d, bias=False)

        def forward(self, x):
            Bq, T, d = x.shape
            h = self.ln1(x)
            parts = (self.qkv(h).split(d, dim=-1) if fused_qkv
                     else (self.q(h), self.k(h), self.v(h)))
            q, k, v = (m.view(Bq, T, s.n_head, -1).transpose(1, 2) for m in parts)
            with attention_backend():
                a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.o(a.transpose(1, 2).reshape(Bq, T, d))
            return x + self.w2(F.gelu(self.w1(self.ln2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte = nn.Embedding(s.vocab_size, s.d_model)
            self.wpe = nn.Embedding(s.seq_len, s.d_model)
            self.blocks = nn.ModuleList(Block() for _ in range(s.n_layer))
            self.lnf = nn.LayerNorm(s.d_model, eps=1e-5)

        def forward(self, idx, targets):
            T = idx.shape[1]
            x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
            for blk in self.blocks:
                x = blk(x)
            logits = self.lnf(x) @ self.wte.weight.T
            return F.cross_entropy(logits.float().view(-1, s.vocab_size), targets.reshape(-1))

    model = GPT().cuda()
    assert sum(p.numel() for p in model.parameters()) == n_params(s)
    load_engine_weights(model, s, init_params(s, seed=1337), fused_qkv)
    return model


def load_engine_weights(model: Any, s: ModelShapes, flat: np.ndarray,
                        fused_qkv: bool = True) -> None:
    """The engine's flat parameters (DESIGN §2 order, `x @ W` with W [in, out]) into the
    PyTorch model (nn.Linear keeps W [out, in])."""
    import torch

    by = {t.name: flat[t.offset:t.offset + t.size].reshape(t.shape) for t in tensor_table(s)}

    def put(p: Any, a: np.ndarray) -> None:
        with torch.no_grad():
            p.copy_(torch.from_numpy(np.ascontiguousarray(a)))

    put(model.wte.weight, by["wte"])
    put(model.wpe.weight, by["wpe"])
    for i, blk in enumerate(model.blocks):
        h = f"h.{i}."
        put(blk.ln1.weight, by[h + "ln1.gamma"])
        put(blk.ln1.bias, by[h + "ln1.beta"])
        put(blk.ln2.weight, by[h + "ln2.gamma"])
        put(blk.ln2.bias, by[h + "ln2.beta"])
        if fused_qkv:
            put(blk.qkv.weight, np.concatenate([by[h + n] for n in QKV], axis=1).T)
        else:
            for m, n in zip((blk.q, blk.k, blk.v), QKV, strict=True):
                put(m.weight, by[h + n].T)
        for m, n in ((blk.o, "attn.W_O"), (blk.w1, "mlp.W_1"), (blk.w2, "mlp.W_2")):
            put(m.weight, by[h + n].T)
    put(model.lnf.weight, by["lnf.gamma"])
    put(model.lnf.bias, by["lnf.beta"])


def torch_step(s: ModelShapes, variant: str) -> tuple[Callable[[np.ndarray, int], None], Any]:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    v = torch_variant(variant)
    model = torch_model(s, v.fused_qkv, v.cudnn_sdpa)
    run = model
    if v.mode == "compile":
        run = torch.compile(model)
    elif v.mode in ("reduce-overhead", "max-autotune"):
        run = torch.compile(model, mode=v.mode)
    decay = [p for p in model.parameters() if p.dim() == 2]
    other = [p for p in model.parameters() if p.dim() != 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": STEP_HP["weight_decay"]},
                             {"params": other, "weight_decay": 0.0}],
                            lr=STEP_HP["lr"], betas=(STEP_HP["beta1"], STEP_HP["beta2"]),
                            eps=STEP_HP["eps"], fused=True)
    dev: dict[int, Any] = {}

    def step(tok: np.ndarray, t: int) -> None:
        key = id(tok)
        if key not in dev:
            dev[key] = torch.from_numpy(tok.astype(np.int64)).cuda()
        d = dev[key]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = run(d[:, :-1], d[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), STEP_HP["max_norm"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        # Without `sync` the host queues the next step while this one runs, as the engine's two
        # steps in flight let it (a synchronize per step adds PyTorch's launch time to each of
        # its steps); the timed loops wait for the device at their end.
        if v.sync:
            torch.cuda.synchronize()

    return step, (model, run, opt)


def torch_clock() -> Clock:
    import torch

    def mark() -> Any:
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    return Clock(mark, lambda a, b: a.elapsed_time(b), torch.cuda.synchronize)
