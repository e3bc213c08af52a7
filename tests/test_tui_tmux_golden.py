"""Golden screens of the real app in a real terminal (tmux) at 80x24, 120x40 and 200x50.

`andrea-tui attach` on a finished fake run (tests/fakerun.py: deterministic records, two
alerts, the engine's health `warning` with its reason), one terminal resized to each size, the
pane captured as text once it holds still. What moves with the clock (times of day, elapsed,
ETA) and the run's temporary path are normalised; the rest must equal tests/golden/tmux_WxH.txt.
After an intended change: `ANDREA_UPDATE_GOLDEN=1 pytest tests/test_tui_tmux_golden.py`, then
review the diff of the golden files.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine import records as rec
from tests.fakerun import write_run
from tests.test_tui_layout import REASON, with_health

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = Path(__file__).parent / "golden"
SIZES = ((80, 24), (120, 40), (200, 50))

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed"),
]

TMUX = ["tmux"]  # a private server per test: see the `tmux_server` fixture


def tmux(*args: str) -> str:
    return subprocess.run([*TMUX, *args], capture_output=True, text=True, check=False,
                          timeout=10).stdout


@pytest.fixture
def tmux_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A tmux server of this test's own (its sessions get this test's environment), ended
    with the test; yields the session name."""
    home = Path(tempfile.mkdtemp(prefix="andrea-tmux-", dir="/tmp"))  # a socket path: 107 bytes
    monkeypatch.setattr(sys.modules[__name__], "TMUX", ["tmux", "-S", str(home / "socket")])
    yield "andrea-golden"
    tmux("kill-server")
    shutil.rmtree(home, ignore_errors=True)


def normalise(text: str, run_dir: Path) -> str:
    """The capture with what depends on the clock or the machine replaced, trailing blanks
    dropped."""
    text = text.replace(str(run_dir), "<RUN>")
    text = re.sub(r"\b\d\d:\d\d:\d\d\b", "HH:MM:SS", text)
    text = re.sub(r"\b(elapsed|ETA) \S+", r"\1 <T>", text)
    return "\n".join(line.rstrip() for line in text.splitlines()).rstrip("\n") + "\n"


def settled(session: str, size: tuple[int, int], timeout: float = 30.0,
            still_for: float = 1.5) -> str:
    """The pane's text once the app has laid itself out at `size` and captures 0.25 s apart
    have stayed the same for `still_for` seconds (longer than the app's 1 s control tick)."""
    deadline = time.monotonic() + timeout
    last, since = "", time.monotonic()
    while time.monotonic() < deadline:
        text = tmux("capture-pane", "-p", "-t", session)
        lines = text.splitlines()
        ready = ("step 1,500/2,000" in text and "grad norm" in text and lines
                 and max(map(len, lines)) >= size[0] - 1 and len(lines) <= size[1])
        if not ready or text != last:
            last, since = (text if ready else ""), time.monotonic()
        elif time.monotonic() - since >= still_for:
            return text
        time.sleep(0.25)
    raise AssertionError(f"the screen did not settle at {size}:\n{last or text}")


def check(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("ANDREA_UPDATE_GOLDEN"):
        path.write_text(text)
    if not path.exists():
        pytest.fail(f"{path} missing: run with ANDREA_UPDATE_GOLDEN=1 to create it")
    assert text == path.read_text(), f"screen differs from {path}:\n{text}"


def test_golden_screens_at_three_sizes_in_tmux(tmp_path: Path, tmux_server: str) -> None:
    session = tmux_server
    paths = write_run(tmp_path / "run", 1500, status="finished", monitor=True)
    with_health(paths, rec.Health.WARNING, REASON, 500)
    # Started at another size: a first resize that changes nothing sends no SIGWINCH.
    subprocess.run([*TMUX, "new-session", "-d", "-s", session, "-x", "100", "-y", "30",
                    f"cd {ROOT} && unset COLUMNS LINES; PYTHONPATH={ROOT} TERM=xterm-256color "
                    f"TZ=UTC XDG_CONFIG_HOME={tmp_path} {sys.executable} -m andrea_tui.cli "
                    f"attach {paths.root}; sleep 60"], check=True, timeout=10)
    for w, h in SIZES:
        tmux("resize-window", "-t", session, "-x", str(w), "-y", str(h))
        text = normalise(settled(session, (w, h)), paths.root)
        lines = text.splitlines()
        assert len(lines) <= h and max(map(len, lines)) <= w
        head = " ".join(lines[:2])
        assert "warning since step 500" in head and "alerts 2" in head, head
        if (w, h) == (80, 24):
            assert "? help" in lines[-1]  # the footer keeps the way to every key
            assert "v events: 2 alerts · warning" in text  # the collapsed events panel
        else:
            assert "health warning since step 500: loss 7.5" in text  # the reason, first words
        check(f"tmux_{w}x{h}.txt", text)
