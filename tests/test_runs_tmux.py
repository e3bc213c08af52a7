"""`andrea-tui runs` in a real terminal (tmux, 80x24): enter opens the dashboard of a live run
(a tests/fakerun.py engine), escape comes back to the browser, and the engine trains on.
ANDREA_SCREEN_CAPTURE=DIR keeps the two screens there."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

from engine.run.control import engine_alive
from tests.fakerun import write_run
from tests.test_tui_tmux import ROOT, screen, session, start_tmux, tmux, wait_for  # noqa: F401

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed"),
]


def keep(name: str, text: str) -> None:
    where = os.environ.get("ANDREA_SCREEN_CAPTURE")
    if where:
        Path(where).mkdir(parents=True, exist_ok=True)
        (Path(where) / name).write_text(text)


def test_escape_goes_back_from_a_dashboard_to_the_runs_browser(session: str,  # noqa: F811
                                                                tmp_path: Path) -> None:
    from tests.test_tui_app import start_fake_engine

    root = tmp_path / "runs"
    write_run(root / "older", 300, t0=1_700_000_000.0)
    live = root / "live"
    engine = start_fake_engine(live, rate=10)
    try:
        start_tmux(session, f"{sys.executable} -m andrea_tui.cli runs {root}")
        tmux("resize-window", "-t", session, "-x", "80", "-y", "24")
        wait_for(lambda: "2 runs under" in screen(session) and "live" in screen(session),
                 "the runs browser", session)
        keep("runs-80x24.txt", screen(session))
        assert "q quit" in screen(session)  # every key of the browser's footer at 80 columns
        tmux("send-keys", "-t", session, "Enter")  # the live run: newest first
        wait_for(lambda: "esc" in screen(session) and "runs under" not in screen(session)
                 and "ANDREA-fake" in screen(session), "the live run's dashboard", session)
        keep("runs-dashboard-80x24.txt", screen(session))
        tmux("send-keys", "-t", session, "Escape")
        # back, and a toast says the engine keeps running (a narrow toast wraps those words)
        wait_for(lambda: "2 runs under" in screen(session) and "keeps" in screen(session),
                 "the runs browser again, and its toast", session)
        assert engine_alive(live)[0] and engine.poll() is None  # escape stopped nothing
        tmux("send-keys", "-t", session, "q")
        wait_for(lambda: "2 runs under" not in screen(session), "the browser's exit", session)
    finally:
        engine.kill()
        engine.wait(timeout=10)
