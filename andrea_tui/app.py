"""The dashboard app: live view of one run directory, and the keys that steer its engine.

The app composes the widgets and the screens, and wires four parts that each do one job:
- RunWatcher (watcher.py) tells which files of the run directory changed, as FilesChanged
  messages that coalesce while one waits;
- FramePacer (pacing.py) decides when to read them (RunReader.poll: only those files, only
  their new bytes) and when to redraw the text panels, at most one frame per
  PANEL_MIN_INTERVAL; the control tick reads every file as a fallback;
- DashboardView (dashboard.py) paints the panels, the banner and, on their own timer and within
  their CPU budget, the charts;
- EngineSupervisor (supervisor.py) follows the engine's lifecycle and sends its signals, only
  through engine.run.control (the verified path of DESIGN §8); its outcomes become toasts here.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import ClassVar

from textual import events, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widgets import Footer, Static

from andrea_tui import liveness, panels
from andrea_tui import settings as user_settings
from andrea_tui.charts import GradNormChart, LossChart, LrChart
from andrea_tui.dashboard import LAST_N, DashboardView
from andrea_tui.linepanel import LinePanel
from andrea_tui.logscreen import LogScreen
from andrea_tui.pacing import FramePacer
from andrea_tui.runreader import RunReader
from andrea_tui.runstate import LossHistory, RunState
from andrea_tui.samplescreen import SamplesScreen
from andrea_tui.screens import ForceStopScreen, HelpScreen, TextScreen
from andrea_tui.supervisor import EngineSupervisor, Outcome
from andrea_tui.textfmt import fmt_duration, fmt_num
from andrea_tui.watcher import FilesChanged, RunWatcher
from engine import records as rec


class Backlog:
    """Files a poll left bytes in, to read at the next frame (a watcher report of our own)."""

    def __init__(self, names: set[str]) -> None:
        self._names = set(names)

    def take(self) -> set[str]:
        return self._names


RESUME_NEWS_S = 60.0  # a resume this much older than the app is old news, not told again
NEWS_SLACK_S = 5.0  # alerts written this long before the app started are news
# Keys that act on the dashboard itself: off (and out of the footer) on a screen pushed over it.
DASHBOARD_ACTIONS = frozenset({
    "toggle", "smoother", "checkpoints", "log", "samples", "help", "export", "events", "system"})
TOAST_WORDS_COMPACT = 90  # an alert toast on a small terminal: its first words (v: the rest)
SEVERE_ALERTS = ("nonfinite", "stall", "diverging")  # told as errors, the others as warnings
# The chart choices `action_toggle` flips (settings.Settings fields), as a message names them.
CHOICES = {"log_y_loss": "log y", "log_y_grad": "log y (grad)", "window": "window",
           "robust_y": "robust y", "x_axis": "x axis", "bell": "bell"}


class AndreaApp(App[str]):
    """Dashboard of one run. `proc` is the engine when this app launched it (else attach mode).
    `andrea-tui` exits with `supervisor.exit_status`."""

    CSS_PATH = "andrea.tcss"
    TITLE = "ANDREA"
    # Short descriptions, `?` first after `esc` (shown only in a dashboard opened from the runs
    # browser): at 80 columns the footer still shows help and the keys
    # that steer the engine (the help screen lists every key).
    BINDINGS: ClassVar[list[Binding]] = [
        # first, so that at 80 columns the footer cuts `i system` (its panel's line says it)
        Binding("escape", "back", "runs", key_display="esc"),  # only when opened from the browser
        Binding("question_mark", "help", "help"),
        Binding("s", "snapshot", "snapshot"),
        Binding("q", "stop", "stop"),
        Binding("d", "detach", "detach"),
        Binding("c", "checkpoints", "ckpts"),
        Binding("l", "log", "log"),
        Binding("v", "events", "events"),
        Binding("p", "samples", "samples"),
        Binding("i", "system", "system"),
        Binding("y", "toggle('log_y_loss')", "log y", show=False),
        Binding("w", "toggle('window')", "window", show=False),
        Binding("g", "toggle('log_y_grad')", "log y (grad)", show=False),
        Binding("left_square_bracket", "smoother(-1)", "less smoothing", show=False),
        Binding("right_square_bracket", "smoother(1)", "more smoothing", show=False),
        Binding("r", "toggle('robust_y')", "robust y", show=False),
        Binding("t", "toggle('x_axis')", "x: step/time", show=False),
        Binding("b", "toggle('bell')", "bell", show=False),
        Binding("e", "export", "export", show=False),
    ]

    def __init__(
        self,
        run_dir: Path,
        *,
        proc: subprocess.Popen | None = None,
        clock: Callable[[], float] = time.time,
        follow: bool = True,
        redraw_interval: float = 2.0,
        control_interval: float = 1.0,
        stop_timeout: float = 120.0,
        on_frame: Callable[[int | None], None] | None = None,
        session_start: float | None = None,
        from_browser: bool = False,
    ) -> None:
        super().__init__()
        self.run_dir = Path(run_dir)
        self.follow = follow
        self.redraw_interval = redraw_interval
        self.control_interval = control_interval
        self.on_frame = on_frame  # benchmark hook: called with the step shown after each update
        self.state = RunState()
        self.reader = RunReader(self.run_dir, self.state)
        self.history_loaded = False
        self.supervisor = EngineSupervisor(self.run_dir, proc, stop_timeout)
        self.view = DashboardView(self, self.state, self.reader.paths.log, clock)
        self.pacer = FramePacer(self._read, self._draw)
        self.watcher = RunWatcher(self.run_dir, self)
        self._started = time.time()
        # When this session began (`andrea-tui` launching the engine: before it started it);
        # only checkpoints written since are news.
        self.session_start = self._started if session_start is None else session_start
        self._clock = clock
        self._halt_told = ""  # the frozen or stalled state a toast has told (once each)
        self.settings = user_settings.load()
        self.from_browser = from_browser  # opened from the runs browser: escape goes back
        self._resumes_told = 0
        self._alerts_seen = 0
        self.alerts_told: list[str] = []  # the alert toasts of this session (tests read them)
        self._loading = False  # a history load is running in its thread

    # ------------------------------------------------------------ layout

    def compose(self) -> ComposeResult:
        yield LinePanel(id="header")
        yield Static(id="banner")
        with Horizontal(id="main"):
            with Vertical(id="charts"):
                yield LossChart(id="loss")
                yield GradNormChart(id="gradnorm")
                yield LrChart(id="lr")
            with Vertical(id="side"):
                yield LinePanel(id="training", classes="panel")
                yield LinePanel(id="bandit", classes="panel")
                yield Static(id="system", classes="panel")
        with Horizontal(id="bottom"):
            yield Static(id="events", classes="panel")
            yield Static(id="logtail", classes="panel")
        yield Static(id="sample", classes="panel")
        with Horizontal(id="summary"):  # a small terminal's stand-in for the four panels above
            yield Static(id="summary-left")
            yield Static(id="summary-right")
        yield Footer()

    def on_resize(self, event: events.Resize) -> None:
        # The event's size: self.size may still be the old one. A header or a panel laid out
        # for the other width is drawn again in the same refresh as the new layout.
        if self.view.fit(*event.size):
            self.pacer.draw_now()
        self.call_after_refresh(self.view.redraw_charts)  # columns for the new width

    def on_mount(self) -> None:
        self.view.fit(*self.size)
        self.view.set_titles()
        self.view.apply(self.settings)
        user_settings.keep_theme(self, self.settings, self._keep_theme)
        # The small files and the events first (resumes, max_steps: what the step records are
        # read with); then a first frame from the end of loss.jsonl; the whole history follows
        # from a thread.
        self.reader.poll(include_loss=False)
        st = self.state
        self.state.set_history(LossHistory.build(self.reader.read_preview(), st.series.ema_alpha,
                                                 list(st.resumes), st.order.fresh()))
        self._check_engine()
        self.pacer.draw_now()
        self.call_after_refresh(self.view.redraw_charts)
        self._loading = True
        self._load_history()
        self.set_interval(self.redraw_interval, self.view.redraw_charts_if_due)
        self.set_interval(self.control_interval, self._tick)

    def exit(self, result: str | None = None, *args, **kwargs) -> None:  # type: ignore[override]
        self.watcher.stop()  # the watchfiles thread ends within one step
        self.pacer.cancel()  # a loop callback, not a Textual timer: not stopped with the app
        super().exit(result, *args, **kwargs)

    def on_unmount(self) -> None:
        self.watcher.stop()  # however the app ends (run_test does not call exit)
        self.pacer.cancel()

    # ------------------------------------------------------------ reading

    @work(thread=True, exclusive=True, group="history", exit_on_error=False)
    def _load_history(self) -> None:
        try:
            history = self.reader.read_history()
        finally:
            self._loading = False
        self.call_from_thread(self._install_history, history)

    def _install_history(self, history: LossHistory) -> None:
        self.state.set_history(history)
        self.reader.loss_backlog = False
        first = not self.history_loaded
        self.history_loaded = True
        self.pacer.reading = True
        self.reader.poll()
        self.pacer.draw_now()
        self.view.redraw_charts()
        if first and self.follow:
            self.watcher.start()

    def on_files_changed(self, message: FilesChanged) -> None:
        self.pacer.files_changed(message)  # its names are taken (and it stops growing) at the frame

    def _read(self, files: Collection[str] | None) -> bool:
        """The pacer's read: the named files (None: all); announce checkpoints they bring."""
        changed = self.reader.poll(changed=files)
        if self.reader.loss_backlog and not self._loading:
            # More than a frame may read (a file replaced, or a burst): off the UI thread.
            self._loading = True
            self._load_history()
        if self.reader.backlog:
            self.pacer.files_changed(Backlog(self.reader.backlog))  # the rest, next frame
        if changed:
            for text in self.supervisor.checkpoint_news(self.state, since=self.session_start):
                self.notify(text, title="checkpoint written", markup=False)
            self._tell_ignored_settings()
            self._tell_alerts()
        return changed

    def _tell_alerts(self) -> None:
        """The engine's new alerts: a toast each (a burst: the newest few and a count), and the
        terminal bell when the user wants it. Alerts from before this app started are history:
        they are on the charts and in the events panel, not news."""
        st = self.state
        new = max(0, min(st.alerts_seen - self._alerts_seen, len(st.alerts)))  # the bound lets old go
        self._alerts_seen = st.alerts_seen
        fresh = [a for a in list(st.alerts)[len(st.alerts) - new:]
                 if a.t >= self._started - NEWS_SLACK_S]
        if not fresh:
            return
        # A small terminal gets one toast with the alert's first words; the events panel
        # (`v`) has every alert in full.
        compact = self.view.compact
        shown = 1 if compact else 2
        for a in fresh[-shown:]:
            self.alerts_told.append(a.alert)
            message = a.message or a.alert
            if compact and len(message) > TOAST_WORDS_COMPACT:
                message = message[:TOAST_WORDS_COMPACT - 1].rsplit(" ", 1)[0] + "… (v: events)"
            self.notify(message, title=f"alert: {a.alert.replace('_', ' ')}",
                        severity="error" if a.alert in SEVERE_ALERTS else "warning",
                        timeout=8 if compact else 15, markup=False)
        if len(fresh) > shown:
            self.notify(f"and {len(fresh) - shown} more alert(s): v shows them",
                        severity="warning", markup=False)
        if self.settings.bell:
            self.bell()

    def _tell_ignored_settings(self) -> None:
        """A resume of this session that trains on with the checkpoint's config while the given
        config says otherwise: name every such setting, loudly and for a while."""
        fresh = [r for r in self.state.resumes[self._resumes_told:]
                 if r.ignored and r.t >= self._started - RESUME_NEWS_S]
        self._resumes_told = len(self.state.resumes)
        for r in fresh:
            lines = "\n".join([f"{i.key}: {i.kept!r} kept (given {i.given!r})" for i in r.ignored]
                              + [a[0].upper() + a[1:] + "." for a in rec.ignored_advice(r.ignored)])
            self.notify(f"resumed at step {r.step} with the checkpoint's config; these settings "
                        f"of the given config are NOT used:\n{lines}", severity="warning",
                        title="config not applied", timeout=30, markup=False)

    def _draw(self) -> None:
        """The pacer's frame: the text panels, with the engine's word in the header."""
        st, sup = self.state, self.supervisor
        note = sup.note(st, self.history_loaded)
        halted = self._halted(note)
        if halted:
            note = halted
        if not note and not self.history_loaded:
            note = f"{st.status} (loading history…)"
        self.view.show(note, dead=sup.engine_dead(st.live, self.history_loaded),
                       halted=bool(halted))
        if self.on_frame is not None:
            self.call_after_refresh(self.on_frame, st.series.last_step)

    def _halted(self, note: str) -> str:
        """The header's word for a verified engine that is not training: frozen (its process
        stopped) or stalled (no step for much longer than its own pace: liveness); "" when it
        trains. Each frozen or stalled spell is told once in a toast."""
        st, sup = self.state, self.supervisor
        now = self._clock()
        idle = liveness.idle_for(st, now)
        idle_text = f"no step for {fmt_duration(idle)}" if idle is not None else ""
        kind = word = toast = ""
        if sup.frozen and sup.controllable:
            kind, word = sup.frozen, note + (f", {idle_text}" if idle_text else "")
            toast = (f"the engine's process (pid {sup.frozen_pid}) is stopped: no step comes "
                     f"until it is continued (kill -CONT {sup.frozen_pid})")
        elif (not note and sup.controllable and self.history_loaded
              and (stall := liveness.stalled(st, now)) is not None):
            kind = "stalled"
            word = f"stalled: {idle_text or f'no progress for {fmt_duration(stall.waited)}'}"
            toast = (f"{word}; this run's median step takes {fmt_num(liveness.step_pace(st))} s, "
                     f"a stall is {fmt_duration(stall.line)} without one")
        if kind and kind != self._halt_told:
            self.notify(toast, title=kind, severity="warning", timeout=15, markup=False)
        self._halt_told = kind
        return word

    # ------------------------------------------------------------ the engine

    def _tick(self) -> None:
        """The control tick: read every file, check the engine, follow a stop to its end."""
        sup = self.supervisor
        self.pacer.poll_all()
        self._check_engine()
        self.pacer.request()  # elapsed and ETA move with the clock
        if sup.stop_done():
            self.pacer.poll_all()
            self.exit(sup.stop_summary(self.state))
        elif (overdue := sup.stop_overdue()) is not None:
            self._tell(overdue)
            self.push_screen(ForceStopScreen(sup.stop_timeout),
                             lambda force: self._tell(sup.answer_force(force)))

    def _check_engine(self) -> None:
        check = self.supervisor.check(self.state)
        if check.refused:
            self.exit(None)  # nothing to watch: andrea-tui prints the engine's error, exits 2
            return
        if check.stop is not None:
            self._tell(check.stop)
        if check.banner is not None:
            self.view.banner(check.banner)
        if check.exited:
            self.pacer.draw_now()

    def _tell(self, outcome: Outcome) -> None:
        """What a request to the engine came to: a toast, and the app's end when it says so."""
        if outcome.message:
            self.notify(outcome.message, severity=outcome.severity, markup=False)
        if outcome.close is not None:
            self.exit(outcome.close)

    # ------------------------------------------------------------ keys

    async def action_quit(self) -> None:
        # Ctrl+Q (also what Ctrl+C points to) must not quietly leave a launched engine behind:
        # it is `d`, which says the engine keeps running and how to reattach.
        self.action_detach()

    def action_snapshot(self) -> None:
        if self.supervisor.may_have_become_reachable():
            self._check_engine()
        self._tell(self.supervisor.snapshot(self.state))

    def action_stop(self) -> None:
        sup = self.supervisor
        if sup.stopping_since is None and sup.may_have_become_reachable():
            self._check_engine()
        outcome = sup.stop(self.state)
        self._tell(outcome)
        if outcome.ok:
            self.pacer.draw_now()  # the header says "stopping…"

    def action_detach(self) -> None:
        self._tell(self.supervisor.detach(self.state))

    def action_back(self) -> None:
        """Back to the runs browser: the engine trains on (as `d`)."""
        self.action_detach()

    def _keep_theme(self, name: str) -> None:
        if name != self.settings.theme:
            self._choose("theme", self.settings.themed(name))

    def action_checkpoints(self) -> None:
        from andrea_tui.ckpt_screens import CheckpointListScreen

        self.push_screen(CheckpointListScreen(self.run_dir))

    def action_log(self) -> None:
        self.push_screen(LogScreen(self.reader.paths.log))

    def action_samples(self) -> None:
        self.push_screen(SamplesScreen(self.reader.paths.samples))

    def action_help(self) -> None:
        self.push_screen(HelpScreen(LAST_N))

    def action_events(self) -> None:
        self.push_screen(TextScreen("events", lambda: panels.all_events(self.state), at_end=True))

    def action_system(self) -> None:
        self.push_screen(TextScreen("system", lambda: panels.system(self.state, self._clock())))

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Dashboard keys mean nothing on a screen pushed over it (a log, a browser): off."""
        if action == "back":  # escape: back to the runs browser that opened the dashboard
            return self.from_browser and len(self.screen_stack) == 1
        if action in DASHBOARD_ACTIONS and len(self.screen_stack) > 1:
            return False
        return True

    def deliver_screenshot(self, filename: str | None = None, path: str | None = None,
                           time_format: str | None = None) -> str | None:
        """The command palette's screenshot: into the run directory (Textual's default,
        ~/Downloads, need not exist), and say where."""
        where = path or str(self.run_dir)
        key = super().deliver_screenshot(filename, where, time_format)
        self.notify(f"screenshot saved in {where}", title="screenshot", markup=False)
        return key

    def _choose(self, what: str, settings: user_settings.Settings) -> None:
        """A chart choice: shown now, kept for the next session (andrea_tui.settings)."""
        self.settings = settings
        self.view.apply(settings)
        if not user_settings.save(settings):
            self.notify(f"{what}: not kept for next time ({user_settings.settings_path()} "
                        "cannot be written)", severity="warning", markup=False)

    def action_toggle(self, name: str) -> None:
        """Flip a chart choice (CHOICES: log y, window, robust y, x axis, bell)."""
        self._choose(CHOICES[name], self.settings.toggled(name))
        if name == "bell":
            self.notify(f"terminal bell on alerts: {'on' if self.settings.bell else 'off'}", markup=False)

    def action_smoother(self, direction: int) -> None:
        self._choose("smoothing", self.settings.smoother(direction))

    def action_export(self) -> None:
        from andrea_tui.export import export_in_background

        export_in_background(self, self.run_dir)
