"""The op twins on the CPU: plain numpy functions writing into caller-given buffers.

Each forward op has a backward twin (DESIGN §3); the CUDA kernels `k_<name>` mirror them and are
tested against them. Conventions, the same for every op:
- Shapes: N = B·T rows, d = d_model, H heads of hd = d/H, F = d_ff, V = vocab size.
- Outputs are written into `out=`-style buffers the caller allocated once; nothing is returned
  except small per-row statistics where noted. Scratch buffers are passed in, too.
- Backward ops ACCUMULATE (+=) into parameter-gradient buffers (dW, dgamma, ...) so
  micro-batches add up. Activation gradients (dx, dqkv, ...) are OVERWRITTEN, except in
  `residual_add_bwd`, whose whole job is to add the skip path into an activation gradient.
- The dtype is whatever the buffers are (float32 for training, float64 for gradient checks).
- No biases anywhere; LayerNorm eps 1e-5; weights are `[in, out]`, `y = x @ W`.
"""

from __future__ import annotations

import math

import numpy as np

LN_EPS = 1e-5
GELU_K = math.sqrt(2.0 / math.pi)
GELU_C = 0.044715
LOSS_ROW_CHUNK = 32  # rows of logits per softmax chunk: 32·V floats stay in L2 cache


def _matmul_acc(a: np.ndarray, b: np.ndarray, acc: np.ndarray, wtmp: np.ndarray) -> None:
    """acc += a @ b, through the flat scratch `wtmp` (numpy's matmul has no beta=1)."""
    tmp = wtmp[: acc.size].reshape(acc.shape)
    np.matmul(a, b, out=tmp)
    acc += tmp


# --- embedding ---------------------------------------------------------------------------------


def embed_fwd(tokens: np.ndarray, wte: np.ndarray, wpe: np.ndarray, out: np.ndarray) -> None:
    """out[b,t,:] = wte[tokens[b,t]] + wpe[t].   tokens int [B,T] (already range-checked),
    wte [V,d], wpe [S,d] with S >= T, out [B,T,d]."""
    T = tokens.shape[1]
    np.take(wte, tokens, axis=0, out=out, mode="clip")
    out += wpe[:T]


def embed_bwd(dout: np.ndarray, tokens: np.ndarray, dwte: np.ndarray, dwpe: np.ndarray) -> None:
    """dwte[v] += Σ_{(b,t): tokens[b,t]=v} dout[b,t];   dwpe[t] += Σ_b dout[b,t].
    dout [B,T,d]."""
    B, T, d = dout.shape
    for b in range(B):
        dwpe[:T] += dout[b]
    np.add.at(dwte, tokens.reshape(-1), dout.reshape(B * T, d))


# --- layer normalisation -----------------------------------------------------------------------


def layernorm_fwd(
    x: np.ndarray,
    gamma: np.ndarray,
    beta: np.ndarray,
    out: np.ndarray,
    mean: np.ndarray,
    rstd: np.ndarray,
) -> None:
    """Per row of x [N,d]: μ = mean(x), σ² = mean((x-μ)²), r = 1/sqrt(σ²+1e-5),
    out = (x-μ)·r·γ + β.   Saves mean [N] and rstd [N] for the backward."""
    d = x.shape[1]
    np.mean(x, axis=1, out=mean)
    np.subtract(x, mean[:, None], out=out)
    var = np.einsum("ij,ij->i", out, out)  # [N] row sums of squares
    var *= 1.0 / d
    var += LN_EPS
    np.sqrt(var, out=var)
    np.divide(1.0, var, out=rstd)
    out *= rstd[:, None]
    out *= gamma
    out += beta


def layernorm_bwd(
    dout: np.ndarray,
    x: np.ndarray,
    gamma: np.ndarray,
    mean: np.ndarray,
    rstd: np.ndarray,
    dx: np.ndarray,
    dgamma: np.ndarray,
    dbeta: np.ndarray,
    xhat: np.ndarray,
) -> None:
    """With x̂ = (x-μ)·r and g = dout·γ:
    dγ += Σ_rows dout·x̂;  dβ += Σ_rows dout;
    dx = r·(g - mean(g) - x̂·mean(g·x̂))   (overwritten).   `xhat` [N,d] is scratch."""
    d = x.shape[1]
    np.subtract(x, mean[:, None], out=xhat)
    xhat *= rstd[:, None]
    # dγ, dβ: column sums; einsum avoids a [N,d] temporary for dout·x̂
    dgamma += np.einsum("ij,ij->j", dout, xhat)
    dbeta += dout.sum(axis=0)
    np.multiply(dout, gamma, out=dx)  # g
    mean_g = dx.mean(axis=1)
    mean_gx = np.einsum("ij,ij->i", dx, xhat)
    mean_gx *= 1.0 / d
    xhat *= mean_gx[:, None]
    dx -= xhat
    dx -= mean_g[:, None]
    dx *= rstd[:, None]


# --- attention ---------------------------------------------------------------------------------


def attn_qkv_fwd(x: np.ndarray, w_qkv: np.ndarray, out: np.ndarray) -> None:
    """out[j] = x @ W_j for j in (Q, K, V).   x [N,d], w_qkv [3,d,d] (W_Q, W_K, W_V as they lie
    in the flat buffer), out [3,N,d]."""
    np.matmul(x, w_qkv, out=out)


def attn_qkv_bwd(
    dqkv: np.ndarray,
    x: np.ndarray,
    w_qkv: np.ndarray,
    dx: np.ndarray,
    dw_qkv: np.ndarray,
    xtmp: np.ndarray,
    wtmp: np.ndarray,
) -> None:
    """dW_j += xᵀ @ dqkv[j];   dx = Σ_j dqkv[j] @ W_jᵀ (overwritten).
    `xtmp` [N,d] and the flat `wtmp` (>= 3·d·d) are scratch."""
    _matmul_acc(x.T, dqkv, dw_qkv, wtmp)
    np.matmul(dqkv[0], w_qkv[0].T, out=dx)
    for j in (1, 2):
        np.matmul(dqkv[j], w_qkv[j].T, out=xtmp)
        dx += xtmp


def _heads(a: np.ndarray, B: int, T: int, n_head: int) -> np.ndarray:
    """[B,T,d] (or [N,d]) → a [B,H,T,hd] strided view (no copy; each [T,hd] stays BLAS-able)."""
    d = a.shape[-1]
    return a.reshape(B, T, n_head, d // n_head).transpose(0, 2, 1, 3)


def _causal_mask(T: int) -> np.ndarray:
    """[T,T] bool, True strictly above the diagonal (future positions)."""
    idx = np.arange(T)
    return idx[:, None] < idx[None, :]


def attn_fwd(qkv: np.ndarray, n_head: int, probs: np.ndarray, out: np.ndarray) -> None:
    """Causal scaled dot-product attention, per batch b and head h:
    S = Q Kᵀ / sqrt(hd), S[i,j] = -inf for j > i, P = softmax_rows(S), Y = P V.
    qkv [3,B,T,d] (heads are column blocks of d), probs [B,H,T,T] (saved P), out [B,T,d]."""
    _, B, T, d = qkv.shape
    q, k, v = (_heads(qkv[j], B, T, n_head) for j in range(3))
    np.matmul(q, k.transpose(0, 1, 3, 2), out=probs)
    probs *= 1.0 / math.sqrt(d // n_head)
    np.copyto(probs, -np.inf, where=_causal_mask(T))
    row_max = probs.max(axis=-1, keepdims=True)
    probs -= row_max
    np.exp(probs, out=probs)
    row_sum = probs.sum(axis=-1, keepdims=True)
    np.divide(1.0, row_sum, out=row_sum)
    probs *= row_sum
    np.matmul(probs, v, out=_heads(out, B, T, n_head))


def attn_bwd(
    dout: np.ndarray,
    qkv: np.ndarray,
    probs: np.ndarray,
    n_head: int,
    dqkv: np.ndarray,
    dprobs: np.ndarray,
) -> None:
    """Backward of `attn_fwd` with P saved:
    dP = dY Vᵀ;  dV = Pᵀ dY;  dS = P ⊙ (dP - rowsum(dP ⊙ P));  dQ = dS K / sqrt(hd);
    dK = dSᵀ Q / sqrt(hd).   dout [B,T,d]; dqkv [3,B,T,d] overwritten; dprobs [B,H,T,T] scratch.
    Masked entries have P = 0, so their dS is 0 with no mask needed."""
    _, B, T, d = qkv.shape
    scale = 1.0 / math.sqrt(d // n_head)
    q, k, v = (_heads(qkv[j], B, T, n_head) for j in range(3))
    dq, dk, dv = (_heads(dqkv[j], B, T, n_head) for j in range(3))
    dy = _heads(dout, B, T, n_head)
    np.matmul(dy, v.transpose(0, 1, 3, 2), out=dprobs)
    np.matmul(probs.transpose(0, 1, 3, 2), dy, out=dv)
    row_dot = np.einsum("bhij,bhij->bhi", dprobs, probs)
    dprobs -= row_dot[..., None]
    dprobs *= probs
    dprobs *= scale
    np.matmul(dprobs, k, out=dq)
    np.matmul(dprobs.transpose(0, 1, 3, 2), q, out=dk)


def attn_out_fwd(y: np.ndarray, w_o: np.ndarray, out: np.ndarray) -> None:
    """out = y @ W_O.   y [N,d], w_o [d,d], out [N,d]."""
    np.matmul(y, w_o, out=out)


def attn_out_bwd(
    dout: np.ndarray,
    y: np.ndarray,
    w_o: np.ndarray,
    dy: np.ndarray,
    dw_o: np.ndarray,
    wtmp: np.ndarray,
) -> None:
    """dW_O += yᵀ @ dout;  dy = dout @ W_Oᵀ (overwritten).  `wtmp` flat scratch (>= d·d)."""
    _matmul_acc(y.T, dout, dw_o, wtmp)
    np.matmul(dout, w_o.T, out=dy)


# --- MLP -----------------------------------------------------------------------------------------


def mlp_fwd(
    x: np.ndarray,
    w1: np.ndarray,
    w2: np.ndarray,
    pre: np.ndarray,
    act: np.ndarray,
    out: np.ndarray,
) -> None:
    """u = x @ W_1;  a = GELU(u) = ½u(1 + tanh(k(u + 0.044715u³))), k = sqrt(2/π);  out = a @ W_2.
    x [N,d], w1 [d,F], w2 [F,d]; saves pre = u [N,F] and act = a [N,F]; out [N,d]."""
    np.matmul(x, w1, out=pre)
    gelu_fwd(pre, act)
    np.matmul(act, w2, out=out)


def gelu_fwd(pre: np.ndarray, act: np.ndarray) -> None:
    """act = GELU(pre) = ½u(1 + tanh(k(u + c·u³))): tanh(u·(k + k·c·u²)), then ½u(1 + that)."""
    np.multiply(pre, pre, out=act)
    act *= GELU_K * GELU_C
    act += GELU_K
    act *= pre
    np.tanh(act, out=act)
    act += 1.0
    act *= pre
    act *= 0.5


def mlp_bwd(
    dout: np.ndarray,
    x: np.ndarray,
    w1: np.ndarray,
    w2: np.ndarray,
    pre: np.ndarray,
    act: np.ndarray,
    dx: np.ndarray,
    dw1: np.ndarray,
    dw2: np.ndarray,
    dpre: np.ndarray,
    ftmp: np.ndarray,
    gtmp: np.ndarray,
    wtmp: np.ndarray,
) -> None:
    """dW_2 += aᵀ @ dout;  da = dout @ W_2ᵀ;  du = da ⊙ GELU'(u);  dW_1 += xᵀ @ du;
    dx = du @ W_1ᵀ (overwritten).  With t = tanh(k(u + c·u³)):
    GELU'(u) = ½(1+t) + ½u(1-t²)·k(1 + 3c·u²) = ½(1+t)·(1 + (1-t)·u·k(1 + 3c·u²)).
    dpre, ftmp, gtmp [N,F] and the flat wtmp (>= d·F) are scratch."""
    _matmul_acc(act.T, dout, dw2, wtmp)
    np.matmul(dout, w2.T, out=dpre)  # da
    gelu_bwd(pre, dpre, ftmp, gtmp)
    _matmul_acc(x.T, dpre, dw1, wtmp)
    np.matmul(dpre, w1.T, out=dx)


def gelu_bwd(pre: np.ndarray, dpre: np.ndarray, ftmp: np.ndarray, gtmp: np.ndarray) -> None:
    """dpre *= GELU'(pre), in place (da becomes du); ftmp and gtmp [N,F] are scratch. With
    t = tanh(k(u + c·u³)):
    GELU'(u) = ½(1+t) + ½u(1-t²)·k(1 + 3c·u²) = ½(1+t)·(1 + (1-t)·u·k(1 + 3c·u²))."""
    # recompute t from u (t = 2a/u - 1 would divide by u ≈ 0)
    np.multiply(pre, pre, out=ftmp)
    np.multiply(ftmp, 3.0 * GELU_K * GELU_C, out=gtmp)
    ftmp *= GELU_K * GELU_C
    ftmp += GELU_K
    ftmp *= pre
    np.tanh(ftmp, out=ftmp)  # t
    gtmp += GELU_K
    gtmp *= pre  # u·k(1+3c·u²)
    ftmp -= 1.0  # t-1
    gtmp *= ftmp  # -(1-t)·u·k(1+3c·u²)
    np.subtract(1.0, gtmp, out=gtmp)  # 1 + (1-t)·u·k(1+3c·u²)
    ftmp += 2.0  # 1+t
    ftmp *= gtmp
    ftmp *= 0.5  # GELU'(u)
    dpre *= ftmp  # du


# --- residual ------------------------------------------------------------------------------------


def residual_add(x: np.ndarray, y: np.ndarray, out: np.ndarray) -> None:
    """out = x + y (the skip connection around a block's branch)."""
    np.add(x, y, out=out)


def residual_add_bwd(dout: np.ndarray, dx: np.ndarray) -> None:
    """dx += dout: the skip path's gradient added into the branch input's gradient.
    (The branch output's gradient is dout itself; the caller hands dout to the branch.)"""
    dx += dout


# --- loss: tied output projection + cross-entropy ------------------------------------------------


def loss_fwd(
    x: np.ndarray,
    wte: np.ndarray,
    targets: np.ndarray,
    logits: np.ndarray,
    row_sum: np.ndarray,
    losses: np.ndarray,
) -> None:
    """z = x @ wteᵀ [N,V] (the tied projection), m = max_v z, s = Σ_v exp(z - m),
    losses[i] = log s_i + m_i - z[i, targets[i]]  (cross-entropy per position).
    Saves, for the backward: logits ← E = exp(z - m) (unnormalised) and row_sum ← s.
    x [N,d], targets int [N] (range-checked), logits [N,V], row_sum [N], losses [N]."""
    N = x.shape[0]
    np.matmul(x, wte.T, out=logits)
    # row chunks keep max / subtract / exp / sum in cache instead of 4 trips to memory
    for r0 in range(0, N, LOSS_ROW_CHUNK):
        r1 = min(N, r0 + LOSS_ROW_CHUNK)
        z = logits[r0:r1]
        m = z.max(axis=1)
        z -= m[:, None]
        zt = z[np.arange(r1 - r0), targets[r0:r1]]  # z_target - m
        np.exp(z, out=z)
        s = row_sum[r0:r1]
        np.sum(z, axis=1, out=s)
        np.log(s, out=losses[r0:r1])
        losses[r0:r1] -= zt


def loss_bwd(
    x: np.ndarray,
    wte: np.ndarray,
    targets: np.ndarray,
    logits: np.ndarray,
    row_sum: np.ndarray,
    scale: float,
    dx: np.ndarray,
    dwte: np.ndarray,
    xtmp: np.ndarray,
    wtmp: np.ndarray,
) -> None:
    """For L = scale · Σ_i loss_i (scale = loss_scale / N gives the mean):
    dz = scale · (softmax(z) - onehot(targets)) = diag(scale/s)·E - scale·onehot;
    dx = dz @ wte (overwritten);  dwte += dzᵀ @ x.
    The row factor scale/s is applied on the small side (x, dx), never on the [N,V] E.
    `logits`/`row_sum` hold E and s from `loss_fwd`; xtmp [N,d], flat wtmp (>= V·d) scratch."""
    r = scale / row_sum  # [N]
    np.multiply(x, r[:, None], out=xtmp)
    _matmul_acc(logits.T, xtmp, dwte, wtmp)  # Eᵀ·diag(r)·x
    np.multiply(x, -scale, out=xtmp)
    np.add.at(dwte, targets, xtmp)  # - scale·onehotᵀ x
    np.matmul(logits, wte, out=dx)
    dx *= r[:, None]
    np.take(wte, targets, axis=0, out=xtmp, mode="clip")
    xtmp *= scale
    dx -= xtmp


# --- optimizer utilities -------------------------------------------------------------------------


def grad_norm_partial(grads: np.ndarray, block: int = 65536) -> np.ndarray:
    """partials[j] = Σ grads[j·block : (j+1)·block]² (float64 out), in a fixed order: the same
    inputs give the same bits. The CUDA twin computes one partial per thread block."""
    n = grads.size
    n_blocks = max(1, -(-n // block))
    partials = np.empty(n_blocks, dtype=np.float64)
    for j in range(n_blocks):
        g = grads[j * block : (j + 1) * block]
        partials[j] = np.dot(g, g)
    return partials


def grad_norm_final(partials: np.ndarray) -> float:
    """norm = sqrt(Σ_j partials[j]) — nan or inf when any gradient was not finite."""
    return float(np.sqrt(np.sum(partials)))


def grad_scale(grads: np.ndarray, s: float) -> None:
    """grads *= s (the clip: s = max_norm / norm when norm > max_norm)."""
    grads *= s


ADAMW_CHUNK = 16384  # elements per pass: the ~14 passes below then run in L1/L2 cache


def adamw(
    params: np.ndarray,
    grads: np.ndarray,
    m: np.ndarray,
    v: np.ndarray,
    decay: np.ndarray,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    t: int,
    tmp: np.ndarray,
) -> None:
    """AdamW, step t (1-based), on flat buffers:
    m = β1·m + (1-β1)·g;  v = β2·v + (1-β2)·g²;  m̂ = m/(1-β1ᵗ);  v̂ = v/(1-β2ᵗ);
    p -= lr·(m̂/(sqrt(v̂)+eps) + wd·p·decay)   (decay: 1 on 2-D tensors, 0 elsewhere; decoupled).
    tmp: scratch of shape [2, >= ADAMW_CHUNK]."""
    bc1 = 1.0 - beta1**t
    inv_sqrt_bc2 = 1.0 / math.sqrt(1.0 - beta2**t)
    n = params.size
    for c0 in range(0, n, ADAMW_CHUNK):
        c1 = min(n, c0 + ADAMW_CHUNK)
        p, g, mc, vc, dc = params[c0:c1], grads[c0:c1], m[c0:c1], v[c0:c1], decay[c0:c1]
        t1, t2 = tmp[0, : c1 - c0], tmp[1, : c1 - c0]
        mc *= beta1
        np.multiply(g, 1.0 - beta1, out=t1)
        mc += t1
        vc *= beta2
        np.multiply(g, g, out=t1)
        t1 *= 1.0 - beta2
        vc += t1
        np.sqrt(vc, out=t1)
        t1 *= inv_sqrt_bc2  # sqrt(v̂)
        t1 += eps
        np.divide(mc, t1, out=t1)
        t1 *= 1.0 / bc1  # m̂/(sqrt(v̂)+eps)
        np.multiply(p, dc, out=t2)
        t2 *= weight_decay
        t1 += t2
        t1 *= lr
        p -= t1
