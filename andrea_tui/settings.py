"""The dashboard's choices a user makes once: kept per user in a small JSON file.

Where: platformdirs' user config directory (`$XDG_CONFIG_HOME/andrea/tui.json`, usually
`~/.config/andrea/tui.json`). Chart smoothing, log y per chart, the robust y-range, the x axis,
the window, the terminal bell on alerts and the colour theme (Textual's, chosen through the
command palette, ctrl+p; `keep_theme` restores it at start and keeps the next choice). A
missing, unreadable or hand-broken file gives the defaults for what it cannot say; a file that
cannot be written costs the choice its persistence, never the session. Headless: `keep_theme`
takes the app as it is, without importing Textual.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from platformdirs import user_config_path

SMOOTHING = (0.0, 0.6, 0.8, 0.9, 0.95, 0.98, 0.99, 0.995)  # EMA alphas `[` and `]` step through
X_AXES = ("step", "time")
THEME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")  # a theme's name as Textual writes it


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
    theme: str = ""  # Textual's theme by name; "" = Textual's default

    def toggled(self, name: str) -> Settings:
        """A yes/no choice flipped; the x axis switched between step and time."""
        if name == "x_axis":
            return replace(self, x_axis="time" if self.x_axis == "step" else "step")
        value = getattr(self, name)
        if not isinstance(value, bool):
            raise ValueError(f"{name} is not a yes/no choice")
        return replace(self, **{name: not value})

    def themed(self, name: str) -> Settings:
        """The same choices with the theme `name`."""
        return replace(self, theme=name)

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
            elif f.name == "theme" and isinstance(v, str) and THEME_RE.fullmatch(v):
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


def keep_theme(app: Any, settings: Settings | None = None,
               on_change: Callable[[str], None] | None = None) -> None:
    """Give a Textual app the kept theme (`settings`, else the file's; a theme this Textual
    does not have is left alone) and keep the theme the user picks from then on: `on_change`
    gets its name (an app that holds its settings keeps it with its other choices); without
    it, it is written into the file here."""
    held = load() if settings is None else settings
    if held.theme and held.theme in app.available_themes and app.theme != held.theme:
        app.theme = held.theme

    def changed(theme: Any) -> None:
        name = getattr(theme, "name", "")
        if not isinstance(name, str) or not THEME_RE.fullmatch(name):
            return
        if on_change is not None:
            on_change(name)
            return
        current = load()
        if name != current.theme and not save(current.themed(name)):
            app.notify(f"theme: not kept for next time ({settings_path()} cannot be written)",
                       severity="warning", markup=False)

    app.theme_changed_signal.subscribe(app, changed)
