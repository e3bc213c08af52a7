"""Paints the dashboard's widgets from a RunState, doing no more work than the change needs.

What it costs to follow a live run is mostly Textual frames and plotext builds, so:
- a panel is updated only when its text changed, and re-laid out only when its height did;
- panels that change with events, samples or the log (not with every step) are built only then;
- the per-source losses (3+ lines) move at most every SOURCE_LOSS_INTERVAL;
- charts redraw on the app's timer, only when the dashboard is the screen shown, only when
  their data changed, and no more often than keeps plotext under CHART_CPU_SHARE of a core,
  yet at least every CHART_MAX_AGE seconds (a chart never lags the run by more than that).
The widgets themselves are composed by the app; this class finds them on the dashboard (the
screen at the bottom of the stack) whatever screen is on top.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar, cast

from rich.text import Text
from textual.app import App
from textual.screen import Screen
from textual.widget import Widget
from textual.widgets import Footer, Static

from andrea_tui import panels
from andrea_tui.chartparts import ChartOptions
from andrea_tui.charts import GradNormChart, LossChart, LrChart
from andrea_tui.linepanel import LinePanel
from andrea_tui.runstate import RunState
from andrea_tui.settings import Settings
from andrea_tui.supervisor import Banner
from engine.runfiles import tail_text

LAST_N = 500  # steps the charts show in window mode
SOURCE_LOSS_INTERVAL = 1.0  # seconds between updates of the per-source losses (3+ lines)
CHART_CPU_SHARE = 0.006  # redraw charts no more often than this share of a core allows...
CHART_MAX_AGE = 1.9  # ...but data that moved is on the charts within this many seconds
LOG_TAIL_READ = 60  # engine.log lines read for the panel (echoes of events are left out)
COMPACT_BELOW = (100, 30)  # columns, rows: smaller terminals collapse events/log/sample/system
NARROW_BELOW = 100  # columns: a shorter header and a compact footer below this width
NARROW_BANDIT = {"bar_width": 2, "name_width": 12}  # the data mixture in a narrow side column
TITLES = (("training", "training"), ("bandit", "data mixture (bandit)"),
          ("system", "system"), ("events", "events"), ("logtail", "engine.log"),
          ("sample", "latest sample"))
W = TypeVar("W", bound=Widget)


class DashboardView:
    """The dashboard's painter for `app`, showing `state` (and engine.log at `log_path`)."""

    def __init__(self, app: App, state: RunState, log_path: Path,
                 clock: Callable[[], float] = time.time) -> None:
        self.app = app
        self.state = state
        self.log_path = Path(log_path)
        self.clock = clock  # wall clock for elapsed/ETA (a fixed one in tests)
        self._widgets: dict[str, Widget] = {}
        self._panel_text: dict[str, tuple] = {}  # panel id -> (text, spans) on screen
        self._slow_panels_key: tuple | None = None
        self._log_key: tuple | None = None
        self._log_lines = Text("")
        self._log_list: list[str] = []
        self.compact = False  # the bottom panels are collapsed into one-line summaries
        self.narrow = False
        self._src_loss_shown: dict[str, float] = {}
        self._src_loss_at = -math.inf
        self._drawn_key: tuple | None = None
        self._charts_drawn_at = -math.inf

    @property
    def screen(self) -> Screen:
        """The screen the dashboard widgets live on (the default screen, at the bottom of the
        stack), whatever screen is on top: `app.query_one` would search the top one."""
        return self.app.screen_stack[0]

    def widget(self, wid: str, kind: type[W]) -> W:
        """The dashboard widget with id `wid`, of type `kind` (looked up once: a query walks
        the DOM)."""
        widget = self._widgets.get(wid)
        if widget is None:  # query_one checks the type; the cache keeps what it found
            widget = self._widgets[wid] = self.screen.query_one(f"#{wid}", kind)
        return cast(W, widget)

    def set_titles(self) -> None:
        for wid, title in TITLES:
            self.widget(wid, Widget).border_title = title

    def fit(self, width: int, height: int) -> bool:
        """On a small terminal the bottom rows would squeeze the charts to ~2 rows and push
        the side panels out: the events, engine.log, sample and system panels collapse into
        a one-line summary each, naming the key that opens them (andrea.tcss `.compact`);
        under NARROW_BELOW columns the header keeps what matters most and the footer its
        keys (`.narrow`). True when either changed: the text panels are then due at once."""
        compact = width < COMPACT_BELOW[0] or height < COMPACT_BELOW[1]
        narrow = width < NARROW_BELOW
        self.screen.set_class(compact, "compact")
        self.screen.set_class(narrow, "narrow")
        if (compact, narrow) != (self.compact, self.narrow):
            self.compact, self.narrow = compact, narrow
            self._slow_panels_key = None  # the summaries (or the panels) at the next frame
            footer = self.screen.query(Footer)
            for f in footer:
                f.compact = narrow
                f.show_command_palette = not narrow
            return True
        return False

    # ------------------------------------------------------------ text panels

    def show(self, note: str, dead: bool, halted: bool = False) -> None:
        """Rebuild the text panels; `note`, `dead` and `halted` are the engine's word for the
        header (panels.header)."""
        st = self.state
        self._set("header", panels.header(st, self.clock(), note, dead=dead, halted=halted,
                                          narrow=self.narrow))
        self._set("training", panels.training(st))
        self._set("bandit", panels.bandit(st, src_loss=self._source_losses(),
                                          **(NARROW_BANDIT if self.narrow else {})))
        # These change with events, samples or the log, not with every step: build them only then.
        slow_key = (id(st.ready), id(st.last_sample), len(st.events),
                    st.events[-1] if st.events else None, self._log_stat(), id(st.system),
                    st.live and int(self.clock() // 10), st.health)
        if slow_key != self._slow_panels_key:
            self._slow_panels_key = slow_key
            self._set("system", panels.system(st, self.clock()))
            self._set("sample", panels.sample(st))
            self._set("events", panels.events(st, 7))
            self._set("logtail", self._log_tail())
            if self.compact:
                lines = panels.summaries(st, self._log_list)
                left, right = Text("\n").join([lines["events"], lines["log"]]), \
                    Text("\n").join([lines["sample"], lines["system"]])
                self._set("summary-left", left)
                self._set("summary-right", right)

    def banner(self, banner: Banner) -> None:
        """Show (or, with empty text, hide) the banner above the panels."""
        if self._panel_text.get("banner") == (banner.text, ()):
            return
        self._panel_text["banner"] = (banner.text, ())
        b = self.widget("banner", Static)
        b.update(banner.text)
        b.set_class(bool(banner.text), "shown")
        b.set_class(banner.error, "error")

    def _set(self, wid: str, content: Text | str) -> None:
        """Update a panel only when its text changed; re-layout only when its height did
        (layout passes cost more than the rest of a frame). A LinePanel (the panels that change
        with every step) repaints only its changed lines and decides on layout itself."""
        plain = content.plain if isinstance(content, Text) else content
        # Styles matter too (the bandit panel highlights a fresh phase change, then stops).
        key = (plain, tuple(content.spans)) if isinstance(content, Text) else (plain, ())
        old = self._panel_text.get(wid)
        if old == key:
            return
        self._panel_text[wid] = key
        relayout = old is None or old[0].count("\n") != plain.count("\n")
        widget = self.widget(wid, Widget)
        if isinstance(widget, LinePanel):
            widget.update(content)
        elif isinstance(widget, Static):
            widget.update(content, layout=relayout)

    def _log_stat(self) -> tuple | None:
        try:
            st = self.log_path.stat()
        except OSError:
            return None
        return st.st_ino, st.st_size, st.st_mtime_ns

    def _log_tail(self) -> Text:
        key = self._log_stat()
        if key != self._log_key:
            self._log_key = key
            lines = panels.log_tail(tail_text(self.log_path, LOG_TAIL_READ), 7)
            self._log_list = lines
            self._log_lines = Text("\n".join(lines) or "(empty)", no_wrap=True,
                                   overflow="ellipsis")
        return self._log_lines

    def _source_losses(self) -> dict[str, float]:
        """The per-source losses to show: refreshed at most every SOURCE_LOSS_INTERVAL (they
        change with every step, on one line per source; the step itself shows at once)."""
        latest = self.state.src_loss
        now = time.monotonic()
        if (now - self._src_loss_at >= SOURCE_LOSS_INTERVAL
                or latest.keys() != self._src_loss_shown.keys()):
            self._src_loss_shown = dict(latest)
            self._src_loss_at = now
        return self._src_loss_shown

    # ------------------------------------------------------------ charts

    def redraw_charts(self) -> None:
        """Hand both charts their data now (each builds only if its picture changed)."""
        self._drawn_key = self._chart_key()
        self._charts_drawn_at = time.monotonic()
        loss, grad = self._charts()
        st = self.state
        evals = [st.evals[k] for k in sorted(st.evals)] if st.evals else []
        alerts = list(st.alerts)
        loss.update_from(st.series, evals, alerts)
        grad.update_from(st.series, st.max_grad_norm, alerts)
        lr = self.widget("lr", LrChart)
        lr.opts = grad.opts  # the x axis and the window of the charts above it
        lr.update_from(st.series, st.resumes, evals)

    def redraw_charts_if_due(self) -> None:
        """The chart timer: redraw when the dashboard shows, the data moved and the CPU budget
        allows."""
        if not self.app.screen_stack:
            return  # torn down: Textual stops the timers after it has removed the screens
        top = self.app.screen
        if top is not self.screen and not top.is_modal:
            return  # the dashboard is covered: nothing to draw until it is shown again
        if self._chart_key() == self._drawn_key:
            return
        cost = sum(c.build_seconds for c in self._charts())
        wait = min(cost / CHART_CPU_SHARE, CHART_MAX_AGE)
        if time.monotonic() - self._charts_drawn_at < wait:
            return  # a large chart on a slow machine: keep plotext within its CPU budget
        self.redraw_charts()

    def apply(self, settings: Settings) -> None:
        """The user's chart choices (andrea_tui.settings), on both charts, drawn at once."""
        loss, grad = self._charts()
        last_n = LAST_N if settings.window else None
        loss.opts = ChartOptions(settings.log_y_loss, settings.robust_y, settings.x_axis, last_n)
        grad.opts = ChartOptions(settings.log_y_grad, settings.robust_y, settings.x_axis, last_n)
        loss.smoothing = settings.smoothing
        self.state.series.set_ema_alpha(settings.smoothing)
        self.redraw_charts()

    def _charts(self) -> tuple[LossChart, GradNormChart]:
        return self.widget("loss", LossChart), self.widget("gradnorm", GradNormChart)

    def _chart_key(self) -> tuple:
        loss, grad = self._charts()
        return self.state.version, loss.size, grad.size
