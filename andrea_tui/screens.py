"""Small screens: help, the full engine log, and the force-stop question."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import ModalScreen, Screen
from textual.widgets import Footer, Log, Static

HELP = """[b]ANDREA keys[/b]

  s   snapshot: SIGUSR1, the engine writes a checkpoint and keeps training
  q   checkpoint and exit: SIGTERM, waits for the stop checkpoint, then exits
  d   detach: leave the engine running, print the attach command
  c   checkpoint browser (enter: details, m: mark two to compare)
  l   full engine log
  y   loss chart: linear / log y
  w   charts: whole run / last {last_n} steps
  ?   this help          ctrl+p  command palette

Keys s and q are off when no live engine can be verified (finished or dead run):
the banner says why. Signals go through engine.run.control, which checks the pid,
its start time, boot id and engine.lock before every signal.

[dim]escape / ? closes this help[/dim]"""


class HelpScreen(ModalScreen[None]):
    BINDINGS: ClassVar[list[Binding]] = [Binding("escape,question_mark,q", "dismiss", "close")]

    def __init__(self, last_n: int) -> None:
        super().__init__()
        self._last_n = last_n

    def compose(self) -> ComposeResult:
        yield Static(HELP.format(last_n=self._last_n), id="help-body")


class LogScreen(Screen[None]):
    """engine.log in full (its last 4 MiB), following appended lines while open."""

    BINDINGS: ClassVar[list[Binding]] = [Binding("escape,l,q", "app.pop_screen", "back")]
    MAX_BYTES = 4 << 20

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = Path(path)
        self._offset = 0

    def compose(self) -> ComposeResult:
        yield Log(max_lines=50_000, auto_scroll=True, id="fulllog")
        yield Footer()

    def on_mount(self) -> None:
        self._read_more(first=True)
        self.set_interval(0.5, self._read_more)

    def _read_more(self, first: bool = False) -> None:
        log = self.query_one(Log)
        try:
            with open(self.path, "rb") as f:
                size = f.seek(0, 2)
                if size < self._offset:
                    self._offset = 0
                    log.clear()
                start = max(self._offset, size - self.MAX_BYTES) if first else self._offset
                f.seek(start)
                data = f.read(self.MAX_BYTES)  # a log that grew by gigabytes: a bite a tick
        except OSError as e:
            if first:
                log.write_line(f"{self.path}: {e.strerror or e}")
            return
        cut = data.rfind(b"\n") + 1  # keep a torn last line for the next read
        self._offset = start + cut
        if cut:
            log.write(data[:cut].decode("utf-8", "replace"))


class ForceStopScreen(ModalScreen[bool]):
    """Asked when the engine did not stop in time: force it (SIGKILL) or keep waiting."""

    BINDINGS: ClassVar[list[Binding]] = [Binding("f", "force", "force (SIGKILL)"),
                Binding("w,escape", "wait", "keep waiting")]

    def __init__(self, waited: float) -> None:
        super().__init__()
        self.waited = waited

    def compose(self) -> ComposeResult:
        yield Static(
            f"[b]The engine did not stop within {self.waited:.0f} s.[/b]\n\n"
            "It may still be writing its stop checkpoint.\n\n"
            "  f  force it (SIGKILL: no stop checkpoint; the last checkpoint stays)\n"
            "  w  keep waiting",
            id="force-body",
        )
        yield Footer()

    def action_force(self) -> None:
        self.dismiss(True)

    def action_wait(self) -> None:
        self.dismiss(False)
