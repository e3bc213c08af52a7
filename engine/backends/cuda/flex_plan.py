"""The causal block plan that the flex attention backward's main kernel reads, built with numpy.

The SM90 deterministic backward that nvidia-cudnn-frontend 1.32.0 ships as CuTe DSL kernels
(`FlexAttentionBackwardSm90`, hd 64, 128x128 tiles, `spt=True`, one mask head) walks a K-major
block plan: for each key block, the query blocks that see it. For a causal mask with T a
multiple of 128 that plan depends only on B and T (not on H, not on the data), so it is built
here once per (B, T) and uploaded; the frontend builds the same tables on the GPU with torch
(plan/builder.py:2245-2279, checked at plan/kernels/__init__.py:266-340).

Contract (nb = T/128 blocks per sequence, R = B·nb plan rows, row r = b·nb + n for key block n
of sequence b; query block m, key block n; all int32 except the masks):
- `cnt`    [1, R]  partial (masked) query blocks per row: 1, the diagonal block m = n.
- `idx`    [nnz]   their query-block index m, local to the sequence (= n); nnz = R.
- `fcnt`   [1, R]  full (unmasked) query blocks per row: m = n+1 .. nb-1, so nb-1-n.
- `fidx`   [nfull] their indices, ascending in m, row after row; nfull = B·nb(nb-1)/2.
- `order`  [nnz]   dQ write rank of each partial block: m - n (spt reverses the count of earlier
                   contributors), 0 on the diagonal. dQ of block m is added in this rank order,
                   which is what makes the backward deterministic.
- `forder` [nfull] the same rank for the full blocks: m - n >= 1.
- `off`    [R+1]   exclusive prefix sums of `cnt` (where row r's entries start in idx/order).
- `foff`   [R+1]   exclusive prefix sums of `fcnt`.
- `masks`  uint32 [nnz, 1, 256, 2]: for each partial block, one 64-bit field per MMA thread
                   (256 threads, 64 accumulator values, bit v%32 of word v//32) set where the
                   value's key <= its query. The same for every diagonal block.
The kernel's 12-tuple (BlockSparseTensors, plan/kernels/__init__.py:19-33) puts None at
positions 4, 10 and 11 (cu_total_m_blocks, sequence_desc, fwd_work_desc); flex_build_main.py's
wrapper builds it from these nine.

Thread t's value v (SdP swapped: the accumulator is keys x queries): wg = t//128, w = (t%128)//32,
l = t%32, v = j + 2i + 4k: key = 64·wg + 16·w + l//4 + 8·i, query = 2·(l%4) + j + 8·k (checked
against the DSL's `partition_C` map by tests/test_flex_bwd.py where the DSL is installed).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.errors import UserError

TILE = 128  # tile_m = tile_n for hd <= 64 (backward_config.py:104-115)
MMA_THREADS = 256  # two warpgroups
VALUES = 64  # accumulator values per thread: 128·128 / 256
HEAD_DIM = 64

FIELDS = ("cnt", "idx", "fcnt", "fidx", "order", "forder", "off", "foff", "masks")


@dataclass(frozen=True)
class FlexPlan:
    """The nine plan arrays for one (B, T), host-side, ready to upload (C-contiguous)."""

    batch: int
    seq_len: int
    cnt: np.ndarray
    idx: np.ndarray
    fcnt: np.ndarray
    fidx: np.ndarray
    order: np.ndarray
    forder: np.ndarray
    off: np.ndarray
    foff: np.ndarray
    masks: np.ndarray

    def arrays(self) -> list[tuple[str, np.ndarray]]:
        """(name, array) in FIELDS' order (set_plan's; ARG_NAMES lists them in the same order)."""
        return [(name, getattr(self, name)) for name in FIELDS]


def fragment_coords() -> tuple[np.ndarray, np.ndarray]:
    """(key, query) int64 [256, 64]: the tile coordinates of each MMA thread's accumulator value."""
    t = np.arange(MMA_THREADS)
    wg, w, lane = t // 128, (t % 128) // 32, t % 32
    v = np.arange(VALUES)
    j, i, k = v % 2, (v // 2) % 2, v // 4
    key = (64 * wg + 16 * w + lane // 4)[:, None] + 8 * i[None]
    query = (2 * (lane % 4))[:, None] + j[None] + 8 * k[None]
    return key, query


def diagonal_mask_words(key: np.ndarray, query: np.ndarray) -> np.ndarray:
    """uint32 [256, 2]: per thread, bit v set where key[t, v] <= query[t, v] (causal, diagonal)."""
    keep = (key <= query).reshape(MMA_THREADS, VALUES // 32, 32).astype(np.uint64)
    words = (keep << np.arange(32, dtype=np.uint64)).sum(-1)
    return words.astype(np.uint32)


def causal_plan(batch: int, seq_len: int, head_dim: int = HEAD_DIM) -> FlexPlan:
    """The causal K-major backward plan for (B, T); T a multiple of 128, hd 64."""
    if head_dim != HEAD_DIM:
        raise UserError(f"flex attention backward: head_dim must be {HEAD_DIM} "
                        f"(the plan's 128x128 tiles), got {head_dim}")
    if batch < 1 or seq_len < 1:
        raise UserError(f"flex attention backward: B and T must be positive, got B={batch}, T={seq_len}")
    if seq_len % TILE:
        raise UserError(f"flex attention backward: T must be a multiple of {TILE}, got T={seq_len} "
                        f"(the causal plan assumes whole 128-row blocks)")
    nb = seq_len // TILE
    n = np.tile(np.arange(nb), batch)  # key block of each plan row
    rows = batch * nb
    fcnt = (nb - 1 - n).astype(np.int32)
    fidx = np.concatenate([np.arange(k + 1, nb) for k in n]).astype(np.int32)
    forder = np.concatenate([np.arange(1, nb - k) for k in n]).astype(np.int32)
    words = diagonal_mask_words(*fragment_coords())
    return FlexPlan(
        batch=batch, seq_len=seq_len,
        cnt=np.ones((1, rows), np.int32),
        idx=n.astype(np.int32),
        fcnt=fcnt[None].copy(),
        fidx=fidx,
        order=np.zeros(rows, np.int32),
        forder=forder,
        off=np.arange(rows + 1, dtype=np.int32),
        foff=np.concatenate([[0], np.cumsum(fcnt)]).astype(np.int32),
        masks=np.ascontiguousarray(np.broadcast_to(words, (rows, 1, MMA_THREADS, 2))),
    )
