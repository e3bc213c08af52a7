"""Golden screens: the dashboard and the checkpoint browser at a fixed size, as text.

Deterministic: injected clock, TZ=UTC, fixed run data, no watchers. Regenerate after an
intended change with `ANDREA_UPDATE_GOLDEN=1 pytest tests/test_tui_golden.py` and review the diff.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import numpy as np
import pytest

from andrea_tui.app import AndreaApp
from andrea_tui.screentext import screen_text
from tests.fakerun import write_run

GOLDEN = Path(__file__).parent / "golden"
SIZE = (120, 40)


@pytest.fixture(autouse=True)
def utc(monkeypatch):
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def _rstrip_lines(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.split("\n"))


def check(name: str, text: str, tmp: Path) -> None:
    # Trailing blanks aside: the length of the tmp path (pytest-9 vs pytest-10) moves them.
    text = text.replace(str(tmp), "<TMP>")
    path = GOLDEN / name
    if os.environ.get("ANDREA_UPDATE_GOLDEN") or not path.exists():
        if not os.environ.get("ANDREA_UPDATE_GOLDEN"):
            pytest.fail(f"{path} missing: run with ANDREA_UPDATE_GOLDEN=1 to create it")
        path.write_text(text)
    assert _rstrip_lines(text) == _rstrip_lines(path.read_text()), f"screen differs from {path}"


async def settle(pilot, cond) -> None:
    for _ in range(400):
        if cond():
            break
        await pilot.pause(0.02)
    await pilot.pause()
    await pilot.pause()


def test_dashboard_golden(tmp_path: Path) -> None:
    paths = write_run(tmp_path / "run", 1500, status="running", monitor=True)

    async def go() -> str:
        app = AndreaApp(paths.root, clock=lambda: 1_700_000_200.0, follow=False,
                        control_interval=3600)
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot, lambda: app.history_loaded)
            return screen_text(app)

    text = asyncio.run(go())
    assert "step 1,500/2,000" in text
    check("dashboard_120x40.txt", text, tmp_path)


def test_checkpoint_browser_golden(tmp_path: Path, monkeypatch) -> None:
    from andrea_tui.ckpt_screens import CheckpointApp
    from engine.run.checkpoint_write import write_checkpoint

    table = [{"name": "wte", "shape": [4, 4], "offset": 0}]
    for step in (10, 20):
        # The write time shows on screen: pin the clock only while writing.
        with monkeypatch.context() as m:
            m.setattr(time, "time", lambda step=step: 1_700_000_000.0 + step)
            write_checkpoint(tmp_path / "checkpoints", step,
                             np.arange(16, dtype=np.float32) * step, np.zeros(16, np.float32),
                             np.ones(16, np.float32), {"bandit": {"phase": 1}}, "periodic",
                             table)

    async def go() -> str:
        app = CheckpointApp(tmp_path)
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot, lambda: len(getattr(app.screen, "entries", [])) == 2)
            return screen_text(app)

    text = asyncio.run(go())
    assert "2 found, 0 invalid" in text
    check("ckpt_list_120x40.txt", text, tmp_path)
