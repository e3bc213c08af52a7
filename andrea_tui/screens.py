"""Small screens: help, a panel shown in full (events, system) and the force-stop question (the
log and samples screens have modules of their own: logscreen.py, samplescreen.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Footer, Static

# Every line fits the help box (HELP_WIDTH less its border and padding): nothing wraps.
HELP = """[b]ANDREA keys[/b]

  s    snapshot: the engine writes a checkpoint, trains on
  q    stop: checkpoint and exit (waits for the checkpoint)
  d    detach: the engine trains on; prints how to attach
  c    checkpoints (enter: details, m: mark two to compare)
  l    engine log: / search, n N next/previous, f filter
  v    events: alerts and health changes, with reasons
  p    samples, by step and prompt
  i    system: memory plan, telemetry, MFU
  e    export: the run's CSV and PNG, into its directory
  ?    this help            ctrl+p  command palette
  esc  back to the runs browser (a dashboard opened from it)

[b]header[/b]: status · health (the engine's judgement: healthy,
warning, diverging, stalled, failed) · step · alerts.
On a small terminal the events, engine.log, sample and
system panels are one line each, led by their key.

[b]charts[/b] (kept for next time)
  y g  log y: loss chart / grad-norm chart (log: every point)
  [ ]  less / more loss smoothing (EMA)
  r    robust loss y-range (the grad-norm axis always is:
       its outliers are ▲ marks on the top edge, counted)
  t    x axis: step / wall time
  w    whole run / last {last_n} steps
  b    terminal bell on alerts: on / off

s and q are off when no live engine can be verified (a
finished or dead run): the banner says why. Signals are
sent only after the pid, its start time, the boot id and
engine.lock are checked.

[dim]escape or ? closes this help; arrows and page keys scroll[/dim]"""
HELP_WIDTH = 72  # the help box: its border, scroll bar and padding leave 64 columns


class HelpScreen(ModalScreen[None]):
    """The keys, in a box that scrolls when the terminal is shorter than the text."""

    BINDINGS: ClassVar[list[Binding]] = [Binding("escape,question_mark,q", "dismiss", "close")]

    def __init__(self, last_n: int) -> None:
        super().__init__()
        self._last_n = last_n

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help-box"):
            yield Static(HELP.format(last_n=self._last_n), id="help-body")

    def on_mount(self) -> None:
        self.query_one("#help-box").focus()  # the arrow and page keys scroll it


class TextScreen(ModalScreen[None]):
    """A dashboard panel in full (`title`), redrawn every second from `build`, scrolling;
    `at_end`: opened at its last line (the newest events)."""

    BINDINGS: ClassVar[list[Binding]] = [Binding("escape,q", "dismiss", "close")]

    def __init__(self, title: str, build: Callable[[], Text], at_end: bool = False) -> None:
        super().__init__()
        self._title = title
        self._build = build
        self._at_end = at_end

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="text-box") as box:
            box.border_title = self._title
            box.border_subtitle = "escape closes"
            yield Static(self._build(), id="text-body")

    def on_mount(self) -> None:
        box = self.query_one("#text-box")
        box.focus()
        if self._at_end:
            self.call_after_refresh(box.scroll_end, animate=False)
        self.set_interval(1.0, self._redraw)

    def _redraw(self) -> None:
        self.query_one("#text-body", Static).update(self._build())


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
