"""ANDREA's training engine: config, data, backends (numpy, CUDA), trainer, checkpoints, control.

The engine never imports the UI. Heavy pieces are imported lazily so `import engine` stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.errors import RunError, UserError

if TYPE_CHECKING:
    from engine.config import Config
    from engine.train.trainer import Trainer

__all__ = ["RunError", "Trainer", "UserError", "load_config"]


def load_config(path: str) -> Config:
    """Load and validate an experiment config (see engine.config)."""
    from engine.config import load_config as _load

    return _load(path)


def __getattr__(name: str) -> Any:
    if name == "Trainer":
        from engine.train.trainer import Trainer

        return Trainer
    raise AttributeError(name)
