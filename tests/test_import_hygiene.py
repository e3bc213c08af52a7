"""andrea_tui never imports pycuda or the engine's backends; the engine never imports textual.

Each check runs in a fresh interpreter and imports every module of the package, then looks at
sys.modules (importing is what would drag a forbidden package in).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PROBE = r"""
import importlib, json, pkgutil, sys
pkg = importlib.import_module(sys.argv[1])
failed = {}
for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
    if m.name.split(".")[-1] == "__main__":
        continue
    try:
        importlib.import_module(m.name)
    except Exception as e:  # a module that cannot import is reported, not hidden
        failed[m.name] = repr(e)
print(json.dumps({"modules": sorted(sys.modules), "failed": failed}))
"""


def imported_by(package: str) -> dict:
    r = subprocess.run([sys.executable, "-c", PROBE, package], cwd=ROOT, capture_output=True,
                       text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_tui_never_imports_pycuda_or_backends() -> None:
    got = imported_by("andrea_tui")
    mods = got["modules"]
    assert "andrea_tui.app" in mods and "andrea_tui.ckpt_screens" in mods
    assert not got["failed"], got["failed"]
    bad = [m for m in mods if m == "pycuda" or m.startswith(("pycuda.", "engine.backends"))]
    assert bad == []


def test_engine_never_imports_textual() -> None:
    got = imported_by("engine")
    mods = got["modules"]
    assert "engine.runfiles" in mods
    bad = [m for m in mods if m.split(".")[0] in ("textual", "textual_plotext", "andrea_tui")]
    assert bad == [], bad


HEADLESS = ("andrea_tui.supervisor", "andrea_tui.pacing")


def test_engine_supervision_and_frame_pacing_are_headless() -> None:
    """Tests drive them without a screen: importing them must not bring Textual in."""
    for module in HEADLESS:
        r = subprocess.run([sys.executable, "-c", f"import json, sys, {module}; "
                            "print(json.dumps(sorted(sys.modules)))"], cwd=ROOT,
                           capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
        assert r.returncode == 0, r.stderr
        mods = json.loads(r.stdout.strip().splitlines()[-1])
        assert module in mods
        assert [m for m in mods if m.split(".")[0] in ("textual", "textual_plotext")] == [], module
