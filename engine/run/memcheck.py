"""The host memory a training run needs, checked before anything big is allocated.

The numpy backend's buffers are host memory; the CUDA backend's live on the device (checked
there, against free device memory, before it allocates: engine.backends.cuda.backend). Beside
them the run holds, on either backend, the host copies a checkpoint is written from: weights,
Adam m and v, 12 bytes a parameter. All of it is checked against what the host has
(engine.backends.hostmem: MemAvailable, a cgroup limit, a safety margin) before the data is
prepared and the trainer built, so a model the host cannot hold is refused with the figures
(exit status 2) instead of being killed by the kernel minutes later.
"""

from __future__ import annotations

from engine.backends import get_backend, hostmem
from engine.config import Config
from engine.model.layout import ModelShapes, n_params


def run_host_plan(cfg: Config, backend: str, resumed: bool) -> dict[str, int]:
    """Host bytes by group that training `cfg` on `backend` (its name) allocates: the backend's
    own (Backend.host_plan: the numpy backend's buffers; none for a GPU's), and the checkpoint
    copies (`host_checkpoint_copy`). On a resume the checkpoint
    already read serves as those copies; what is still to come is then the initial weights the
    trainer draws before it loads the checkpoint's (`initial_weights`, 4 bytes a parameter)."""
    shapes = ModelShapes.from_config(cfg.model)
    n = n_params(shapes)
    plan: dict[str, int] = {}
    plan.update(get_backend(backend).host_plan(shapes, cfg.train.batch_size,
                                               separate_micro=cfg.train.grad_accum > 1))
    if resumed:
        plan["initial_weights"] = 4 * n
    else:
        plan["host_checkpoint_copy"] = 12 * n
    return plan


def require_host_memory(cfg: Config, backend: str, resumed: bool) -> None:
    """UserError (exit status 2) with the plan's groups, their total, the margin and what is
    available, when the run does not fit in this host's memory."""
    hostmem.require(run_host_plan(cfg, backend, resumed), f"{cfg.name} on the {backend} backend")
