"""Data parallelism for the training loop: the gradient sum across ranks, and the share of the
global batch that is this rank's.

Every rank draws the whole global batch from the same sampler stream (world × grad_accum
micro-batches of batch_size rows, in one order), keeps the micro-batches m with m // grad_accum
== rank, and forms each one's gradient; the reducer then sums the ranks' gradients in fp32, so
that every rank holds the same bits and takes the same clip and AdamW step. Because a micro-batch
beyond the first is formed on its own and added whole (Trainer.forward_backward), two ranks with
batch B give the same bits as one rank with batch B and grad_accum 2.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine import env
from engine.errors import UserError
from engine.run.comm import Channel

if TYPE_CHECKING:
    from engine.backends.cuda.backend import CudaBackend
    from engine.backends.numpy.model import NumpyBackend


class HostReducer:
    """The numpy backend: gradients summed on the host through the control channel, between
    the backward and the step."""

    in_step = False

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self.world = channel.world.size

    def reduce(self, backend: NumpyBackend) -> None:
        g = backend.grad_array()
        g[:] = self.channel.allreduce_sum(g)


class NcclReducer:
    """The CUDA backend: fp32 NCCL all-reduces in place, inside the one-graph step (a bucket per
    layer as the backward completes it: `in_step`, the config's gpu.ddp_overlap) or, after
    several micro-batches or without it, one on the training stream before the optimizer
    step."""

    def __init__(self, channel: Channel, in_step: bool = True) -> None:
        from engine.backends.cuda.nccl import Nccl

        w = channel.world
        self.world = w.size
        self.in_step = in_step
        self.nccl = Nccl()
        uid = channel.broadcast(self.nccl.new_id() if w.main else b"")
        self.nccl.init(w.size, w.rank, uid)
        # A rank that dies leaves the others blocked in the all-reduce: end it from the watch.
        channel.on_peer_lost(lambda _why: self.nccl.abort())

    def reduce(self, backend: CudaBackend) -> None:
        ptr, n, stream = backend.grad_device()
        self.nccl.all_reduce_sum(ptr, n, stream)

    def all_reduce_sum(self, ptr: int, count: int, stream: Any) -> None:
        """One bucket, for the backend's one-graph step (CudaBackend.train_step(reducer=)),
        which sums the gradients bucket by bucket while its backward goes on."""
        self.nccl.all_reduce_sum(ptr, count, stream)

    def close(self) -> None:
        self.nccl.close()


def collective_settings(reducer: NcclReducer, backend: CudaBackend
                        ) -> dict[str, bool | int | str]:
    """What decides which NCCL calls a rank makes in a step, and in which order: the all-reduce
    inside the one-graph step or after it, the fused step (both in `resolved`), CUDA graphs
    (the eager warm-up); and what decides its bits (the rest of the backend's `resolved`
    config: attention path, switches), so that no rank computes otherwise unseen (only rank 0
    writes a log)."""
    return {**{f"gpu.{k}": v for k, v in backend.resolved.items()},
            "gpu.ddp_overlap": reducer.in_step,
            env.CUDA_GRAPHS.name: backend.use_graphs}


def _said(v: bool | int | str | None) -> str:
    if v is None:
        return "unset"
    if isinstance(v, bool):
        return "on" if v else "off"
    return str(v)


def check_same_collectives(per_rank: list[dict[str, bool | int | str]]) -> None:
    """Every rank must make the same collective calls, or they pair an all-reduce of one size
    with another's and hang, and compute with the same settings: refuse a job whose ranks
    were started with other settings."""
    first = per_rank[0]
    for rank, mine in enumerate(per_rank[1:], 1):
        differ = sorted(k for k in first.keys() | mine.keys() if first.get(k) != mine.get(k))
        if differ:
            said = ", ".join(f"{k} on rank 0 {_said(first.get(k))}, on rank {rank} "
                             f"{_said(mine.get(k))}" for k in differ)
            raise UserError(f"data parallel: the ranks resolved the config's gpu section "
                            f"otherwise ({said}); give every rank the same environment "
                            f"({env.CUDA_GRAPHS.name}, {env.CUDA_SYNC.name}, the same "
                            f"{env.FLEX_LIB.name} or {env.FLEX_CACHE.name}: a rank where the "
                            f"flex backward is refused or fails runs cuDNN's, and only rank 0 "
                            f"writes a log) and the same cuDNN")


def make_reducer(channel: Channel, on_gpu: bool, overlap: bool) -> HostReducer | NcclReducer:
    """The gradient sum for a backend on GPUs (NCCL; `overlap`: inside the one-graph step, the
    config's gpu.ddp_overlap) or on the CPU (through the channel)."""
    return NcclReducer(channel, overlap) if on_gpu else HostReducer(channel)


def my_micro_batches(world_rank: int, grad_accum: int, total: int) -> range:
    """The global micro-batch indices of one rank (contiguous: rank r has r·A … r·A + A - 1)."""
    return range(world_rank * grad_accum, min(total, (world_rank + 1) * grad_accum))
