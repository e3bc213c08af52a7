"""The dashboard's choices a user makes once: kept per user in a small JSON file.

Where: platformdirs' user config directory (`$XDG_CONFIG_HOME/andrea/tui.json`, usually
`~/.config/andrea/tui.json`). Chart smoothing, log y per chart, the robust y-range, the x axis,
the window and the terminal bell on alerts. A missing, unreadable or hand-broken file gives the
defaults for what it cannot say; a file that cannot be written costs the choice its persistence,
never the session. Headless.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from platformdirs import user_config_path

SMOOTHING = (0.0, 0.6, 0.8, 0.9, 0.95, 0.98, 0.99, 0.995)  # EMA alphas `[` and `]` step through
X_AXES = ("step", "time")


def settings_path() -> Path:
    return user_config_path("andrea", appauthor=False) / "tui.json"


@dataclass(frozen=True)
class Settings:
    smoothing: float = 0.9
    log_y_loss: bool = False
    log_y_grad: bool = False
    robust_y: bool = False
    x_axis: str = "step"
    window: bool = False
    bell: bool = True

    def toggled(self, name: str) -> Settings:
        """A yes/no choice flipped; the x axis switched between step and time."""
        if name == "x_axis":
            return replace(self, x_axis="time" if self.x_axis == "step" else "step")
        value = getattr(self, name)
        if not isinstance(value, bool):
            raise ValueError(f"{name} is not a yes/no choice")
        return replace(self, **{name: not value})

    def smoother(self, direction: int) -> Settings:
        """One notch more (+1) or less (-1) smoothing."""
        i = min(range(len(SMOOTHING)), key=lambda k: abs(SMOOTHING[k] - self.smoothing))
        i = max(0, min(len(SMOOTHING) - 1, i + direction))
        return replace(self, smoothing=SMOOTHING[i])

    @classmethod
    def from_json(cls, obj: Any) -> Settings:
        """Each field that reads well; the default for the others."""
        if not isinstance(obj, dict):
            return cls()
        out: dict[str, Any] = {}
        for f in fields(cls):
            v, d = obj.get(f.name), getattr(cls, f.name)
            if isinstance(d, bool):
                if isinstance(v, bool):
                    out[f.name] = v
            elif isinstance(d, float):
                if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1:
                    out[f.name] = float(v)
            elif f.name == "x_axis" and v in X_AXES:
                out[f.name] = v
        return cls(**out)


def load(path: Path | None = None) -> Settings:
    path = settings_path() if path is None else path
    try:
        if path.stat().st_size > 65536:
            return Settings()
        return Settings.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, RecursionError):
        return Settings()


def save(settings: Settings, path: Path | None = None) -> bool:
    """Write the settings (atomically); False when they could not be kept."""
    path = settings_path() if path is None else path
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(asdict(settings), indent=2) + "\n")
        os.replace(tmp, path)
        return True
    except OSError:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        return False
