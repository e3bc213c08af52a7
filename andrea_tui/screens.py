"""Small screens: help and the force-stop question (the log and samples screens have modules of
their own: logscreen.py, samplescreen.py)."""

from __future__ import annotations

from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import ModalScreen
from textual.widgets import Footer, Static

# Every line fits the help box (HELP_WIDTH less its border and padding): nothing wraps.
HELP = """[b]ANDREA keys[/b]

  s    snapshot: the engine writes a checkpoint, trains on
  q    checkpoint and exit (waits for the stop checkpoint)
  d    detach: the engine trains on; prints how to attach
  c    checkpoints (enter: details, m: mark two to compare)
  l    engine log: / search, n N next/previous, f filter
  p    samples, by step and prompt
  e    export: the run's CSV and PNG, into its directory
  ?    this help            ctrl+p  command palette

[b]charts[/b] (kept for next time)
  y g  log y: loss chart / grad-norm chart
  [ ]  less / more loss smoothing (EMA)
  r    robust y-range: outliers leave the scale alone
  t    x axis: step / wall time
  w    whole run / last {last_n} steps
  b    terminal bell on alerts: on / off

s and q are off when no live engine can be verified (a
finished or dead run): the banner says why. Signals are
sent only after the pid, its start time, the boot id and
engine.lock are checked.

[dim]escape or ? closes this help[/dim]"""
HELP_WIDTH = 70


class HelpScreen(ModalScreen[None]):
    BINDINGS: ClassVar[list[Binding]] = [Binding("escape,question_mark,q", "dismiss", "close")]

    def __init__(self, last_n: int) -> None:
        super().__init__()
        self._last_n = last_n

    def compose(self) -> ComposeResult:
        yield Static(HELP.format(last_n=self._last_n), id="help-body")


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
