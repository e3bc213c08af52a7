"""The dashboard app: live view of one run directory, and the keys that steer its engine.

Data flow: watchfiles (in a thread of its own) reports which files of the run directory changed;
the next frame reads just those, and only their new bytes, into the RunState (`RunReader.poll`);
the 1 s control tick reads every file as a fallback. What it costs to follow a live run is mostly
Textual frames and plotext builds, so:
- text panels update at once, but at most one frame per PANEL_MIN_INTERVAL (later changes wait
  for the end of that interval: a run logging 10 steps/s costs 5 frames/s, not 10+); reading
  waits for the frame too, so one frame reads what several wake-ups reported;
- charts redraw on a timer, only when the dashboard is the screen shown, only when their data
  changed, and no more often than keeps plotext under CHART_CPU_SHARE of a core.
Signals go through engine.run.control (the verified path of DESIGN §8); the app never signals a pid
it has not verified.
"""

from __future__ import annotations

import asyncio
import math
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

from rich.markup import escape
from rich.text import Text
from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widgets import Footer, Static

from andrea_tui import panels
from andrea_tui.charts import GradNormChart, LossChart
from andrea_tui.linepanel import LinePanel
from andrea_tui.runreader import RunReader
from andrea_tui.runstate import LossHistory, RunState
from andrea_tui.screens import ForceStopScreen, HelpScreen, LogScreen
from engine.run.control import ControlRefused, engine_alive, signal_engine
from engine.runfiles import read_json, tail_text

LAST_N = 500
PANEL_MIN_INTERVAL = 0.2  # seconds between text-panel frames while data streams in
SOURCE_LOSS_INTERVAL = 1.0  # seconds between updates of the per-source losses (3+ lines)
CHART_CPU_SHARE = 0.006  # redraw charts no more often than this share of a core allows
COMPACT_BELOW = (100, 30)  # columns, rows: smaller terminals drop events/log/sample rows


class AndreaApp(App[str]):
    """Dashboard of one run. `proc` is the engine when this app launched it (else attach mode)."""

    CSS_PATH = "andrea.tcss"
    TITLE = "ANDREA"
    BINDINGS: ClassVar[list[Binding]] = [
        Binding("s", "snapshot", "snapshot"),
        Binding("q", "stop", "checkpoint+exit"),
        Binding("d", "detach", "detach"),
        Binding("c", "checkpoints", "checkpoints"),
        Binding("l", "log", "log"),
        Binding("y", "toggle_log_y", "log y"),
        Binding("w", "toggle_window", "window"),
        Binding("question_mark", "help", "help"),
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
    ) -> None:
        super().__init__()
        self.run_dir = Path(run_dir)
        self.proc = proc
        self.clock = clock
        self.follow = follow
        self.redraw_interval = redraw_interval
        self.control_interval = control_interval
        self.stop_timeout = stop_timeout
        self.on_frame = on_frame  # benchmark hook: called with the step shown after each update
        self.state = RunState()
        self.reader = RunReader(self.run_dir, self.state)
        self.history_loaded = False
        self.controllable = False
        self.control_reason = "checking the engine…"
        self.stopping_since: float | None = None
        self.force_asked = False
        self.engine_exit: int | None = None
        self.engine_error: str | None = None  # the launched engine's error line when it refused
        self._stop_deferred = False  # `q` came before the launched engine could take a signal
        self._drawn_key: tuple | None = None
        self._charts_drawn_at = -math.inf
        self._panels_at = -math.inf
        self._panel_timer: asyncio.TimerHandle | None = None
        self._ckpt_seen = 0
        self._snapshot_pending = False
        self._stop_event = threading.Event()  # ends the watchfiles thread
        self._pending_files: set[str] | None = set()  # changed since the last read; None: all
        self._panels_due = False  # the state changed (or time passed) since the panels were built
        self._src_loss_shown: dict[str, float] = {}
        self._src_loss_at = -math.inf
        self._panel_text: dict[str, tuple] = {}  # panel id -> (text, spans) on screen
        self._statics: dict[str, Static | LinePanel] = {}
        self._slow_panels_key: tuple | None = None
        self._log_key: tuple | None = None
        self._log_lines = Text("")

    # ------------------------------------------------------------ layout

    def compose(self) -> ComposeResult:
        yield LinePanel(id="header")
        yield Static(id="banner")
        with Horizontal(id="main"):
            with Vertical(id="charts"):
                yield LossChart(id="loss")
                yield GradNormChart(id="gradnorm")
            with Vertical(id="side"):
                yield LinePanel(id="training", classes="panel")
                yield LinePanel(id="bandit", classes="panel")
                yield Static(id="memory", classes="panel")
        with Horizontal(id="bottom"):
            yield Static(id="events", classes="panel")
            yield Static(id="logtail", classes="panel")
        yield Static(id="sample", classes="panel")
        yield Footer()

    @property
    def dashboard(self):
        """The screen the dashboard widgets live on (the default screen, at the bottom of the
        stack), whatever screen is on top: `self.query_one` would search the top one."""
        return self.screen_stack[0]

    def _widget(self, wid: str):
        widget = self._statics.get(wid)
        if widget is None:  # looked up once: a query walks the DOM on every call
            widget = self._statics[wid] = self.dashboard.query_one(f"#{wid}")
        return widget

    @property
    def exit_status(self) -> int:
        """The status `andrea-tui` exits with: 1 when the engine this app launched failed."""
        if self.proc is not None and self.engine_exit is None:
            code = self.proc.poll()
            if code is not None:
                self.engine_exit = code
        if self.engine_error is not None:
            return 2  # the engine refused its input before it started: a usage error
        return 1 if self.proc is not None and self.engine_exit not in (None, 0) else 0

    def _fit_layout(self) -> None:
        """On a small terminal the bottom rows would squeeze the charts to ~2 rows and push
        the side panels out: hide them (the `l` key still shows the log) and keep the charts
        readable (andrea.tcss `.compact`)."""
        width, height = self.size
        compact = width < COMPACT_BELOW[0] or height < COMPACT_BELOW[1]
        self.dashboard.set_class(compact, "compact")

    def on_resize(self) -> None:
        self._fit_layout()

    def on_mount(self) -> None:
        self._fit_layout()
        for wid, title in (("training", "training"), ("bandit", "data mixture (bandit)"),
                           ("memory", "memory plan"), ("events", "events"),
                           ("logtail", "engine.log"), ("sample", "latest sample")):
            self._widget(wid).border_title = title
        # First frame from the end of loss.jsonl; the whole history follows from a thread.
        self.state.set_history(LossHistory.build(self.reader.read_preview()))
        self.reader.poll(include_loss=False)
        self._check_engine()
        self._update_panels()
        self.call_after_refresh(self._redraw_charts)
        self._load_history()
        self.set_interval(self.redraw_interval, self._redraw_if_dirty)
        self.set_interval(self.control_interval, self._tick)

    # ------------------------------------------------------------ reading

    @work(thread=True, exclusive=True, group="history", exit_on_error=False)
    def _load_history(self) -> None:
        history = self.reader.read_history()
        self.call_from_thread(self._install_history, history)

    def _install_history(self, history: LossHistory) -> None:
        self.state.set_history(history)
        self.history_loaded = True
        self.reader.poll()
        self._update_panels()
        self._redraw_charts()
        if self.follow and not self._stop_event.is_set():
            # A daemon thread, not a Textual thread worker: those run in the loop's default
            # executor, which asyncio.run() joins at exit.
            threading.Thread(target=self._watch, args=(asyncio.get_running_loop(),),
                             name="andrea-watch", daemon=True).start()

    def _watch(self, loop: asyncio.AbstractEventLoop) -> None:
        """Hand each set of changed file names to the UI loop (runs in its own thread). The
        synchronous watcher costs the UI loop one callback per wake-up; `awatch` costs a task
        group and a worker-thread round trip each time. No timeout wake-ups: the control tick
        polls every file anyway."""
        from watchfiles import watch

        try:
            # The directory, not the files: files that appear later or are replaced are seen.
            for changes in watch(self.run_dir, recursive=False, watch_filter=None,
                                 stop_event=self._stop_event, step=20, debounce=200,
                                 rust_timeout=0, raise_interrupt=False):
                names = {Path(path).name for _, path in changes}
                loop.call_soon_threadsafe(self._files_changed, names)
        except Exception:  # a traceback from this thread would garble the screen
            # The loop closed (the app has gone), or the directory cannot be watched (e.g. it
            # was removed): the control tick's poll still follows whatever is left.
            return

    def on_unmount(self) -> None:
        self._stop_event.set()  # however the app ends (run_test does not call exit)

    def _files_changed(self, names: set[str]) -> None:
        """watchfiles saw `names` change: read them in the next frame (now, if one is allowed)."""
        if self._pending_files is not None:
            self._pending_files |= names
        self._schedule_frame()

    def _read_pending(self) -> bool:
        """Read the files reported changed since the last read; True if the state changed."""
        if not self.history_loaded:
            return False
        files, self._pending_files = self._pending_files, set()
        if files is not None and not files:
            return False
        changed = self.reader.poll(changed=files)
        if changed:
            self._panels_due = True
            self._announce_checkpoints()
        return changed

    def poll_now(self) -> bool:
        """Read every file for what was appended; update the text panels soon if anything
        changed (at once, if a frame is allowed now)."""
        self._pending_files = None
        changed = self._read_pending()
        if changed:
            self._request_panels()
        return changed

    def _request_panels(self) -> None:
        """Update the text panels now, or at the end of the current PANEL_MIN_INTERVAL."""
        self._panels_due = True
        self._schedule_frame()

    def _schedule_frame(self) -> None:
        if self._panel_timer is not None:
            return  # a frame is already due; it will read and show this change too
        wait = self._panels_at + PANEL_MIN_INTERVAL - time.monotonic()
        if wait <= 0:
            self._frame()
        else:
            # A bare loop callback: a Textual Timer is a task of its own, several times dearer,
            # and this runs up to 1/PANEL_MIN_INTERVAL times a second.
            self._panel_timer = asyncio.get_running_loop().call_later(wait, self._frame)

    def _frame(self) -> None:
        """Read what changed; rebuild the panels if the state moved or an update was asked for."""
        self._panel_timer = None
        self._read_pending()
        if self._panels_due:
            self._update_panels()

    async def action_quit(self) -> None:
        # Ctrl+Q (also what Ctrl+C points to) must not quietly leave a launched engine behind:
        # it is `d`, which says the engine keeps running and how to reattach.
        self.action_detach()

    def exit(self, result: str | None = None, *args, **kwargs) -> None:  # type: ignore[override]
        self._stop_event.set()  # the watchfiles thread ends within one step
        if self._panel_timer is not None:
            self._panel_timer.cancel()  # a loop callback, not a Textual timer: not auto-stopped
            self._panel_timer = None
        super().exit(result, *args, **kwargs)

    # ------------------------------------------------------------ drawing

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
        widget = self._widget(wid)
        if isinstance(widget, LinePanel):
            widget.update(content)
        else:
            widget.update(content, layout=relayout)

    def _log_stat(self) -> tuple | None:
        try:
            st = self.reader.paths.log.stat()
        except OSError:
            return None
        return st.st_ino, st.st_size, st.st_mtime_ns

    def _log_tail(self) -> Text:
        key = self._log_stat()
        if key != self._log_key:
            self._log_key = key
            lines = tail_text(self.reader.paths.log, 7)
            self._log_lines = Text("\n".join(lines) or "(empty)", no_wrap=True,
                                   overflow="ellipsis")
        return self._log_lines

    def _update_panels(self) -> None:
        if self._panel_timer is not None:
            self._panel_timer.cancel()
            self._panel_timer = None
        self._read_pending()  # show the freshest state there is
        self._panels_due = False
        self._panels_at = time.monotonic()
        st = self.state
        note = ""
        if self._stop_deferred:
            note = "stopping… (waiting for the engine to start)"
        elif self.stopping_since is not None:
            note = "stopping… (waiting for the stop checkpoint)"
        elif self.engine_exit is not None and self.proc is not None:
            note = f"engine ended: {self._exit_how()}"
        elif self.engine_dead:
            note = f"dead (state.json says {st.status})"
        elif not self.history_loaded:
            note = f"{st.status} (loading history…)"
        self._set("header", panels.header(st, self.clock(), note, dead=self.engine_dead))
        self._set("training", panels.training(st))
        self._set("bandit", panels.bandit(st, src_loss=self._source_losses()))
        # These change with events, samples or the log, not with every step: build them only then.
        slow_key = (id(st.ready), id(st.last_sample), len(st.events),
                    st.events[-1] if st.events else None, self._log_stat())
        if slow_key != self._slow_panels_key:
            self._slow_panels_key = slow_key
            self._set("memory", panels.memory(st))
            self._set("sample", panels.sample(st))
            self._set("events", panels.events(st, 7))
            self._set("logtail", self._log_tail())
        if self.on_frame is not None:
            self.call_after_refresh(self.on_frame, st.series.last_step)

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

    def _charts(self) -> tuple[LossChart, GradNormChart]:
        return self._widget("loss"), self._widget("gradnorm")

    def _chart_key(self) -> tuple:
        loss, grad = self._charts()
        return self.state.version, loss.size, grad.size

    def _redraw_charts(self) -> None:
        """Hand both charts their data now (each builds only if its picture changed)."""
        self._drawn_key = self._chart_key()
        self._charts_drawn_at = time.monotonic()
        loss, grad = self._charts()
        loss.update_from(self.state.series)
        grad.update_from(self.state.series, self.state.max_grad_norm)

    def _redraw_if_dirty(self) -> None:
        if self.screen is not self.screen_stack[0] and not self.screen.is_modal:
            return  # the dashboard is covered: nothing to draw until it is shown again
        if self._chart_key() == self._drawn_key:
            return
        cost = sum(c.build_seconds for c in self._charts())
        if time.monotonic() - self._charts_drawn_at < cost / CHART_CPU_SHARE:
            return  # a large chart on a slow machine: keep plotext within its CPU budget
        self._redraw_charts()

    def _banner(self, text: str, error: bool = False) -> None:
        if self._panel_text.get("banner") == (text, ()):
            return
        self._panel_text["banner"] = (text, ())
        b = self._widget("banner")
        b.update(text)
        b.set_class(bool(text), "shown")
        b.set_class(error, "error")

    # ------------------------------------------------------------ the engine

    @property
    def engine_dead(self) -> bool:
        """The run's files say it is live but no engine is: attach mode with no verified
        engine, or the launched process has exited."""
        if not self.state.live:
            return False
        if self.proc is not None:
            return self.engine_exit is not None
        return not self.controllable and self.history_loaded

    def _engine_json_pid(self) -> object:
        return (read_json(self.reader.paths.engine) or {}).get("pid")

    def _ours(self) -> bool:
        """Launch mode: the engine of this run directory is the process we started and it is
        still alive (a refused launch must never steer somebody else's engine)."""
        return (self.proc is not None and self.proc.poll() is None
                and self._engine_json_pid() == self.proc.pid)

    def _check_engine(self) -> None:
        alive, reason = engine_alive(self.run_dir)
        if self.proc is not None and self.engine_exit is None:
            code = self.proc.poll()
            if code is not None:
                self._engine_exited(code)
        if self.proc is not None and alive and not self._ours():
            alive = False
            reason = (f"the engine running here is not the one this app started (pid "
                      f"{self.proc.pid})")
        self.controllable = alive
        if self._stop_deferred and alive:
            self._stop_deferred = False  # its handlers exist now: stop it the verified way
            if self._send(signal.SIGTERM, "stop"):
                self.stopping_since = time.monotonic()
        # Messages name files by full path; inside this run directory the file name is enough.
        self.control_reason = reason.replace(f"{self.run_dir}/", "")
        if self.engine_exit is not None:
            return
        if alive:
            self._banner("")
        elif self.proc is not None:
            self._banner("engine starting…" if self.state.status == "starting"
                         else f"engine not reachable: {escape(self.control_reason)}")
        else:
            self._banner(f"read-only: {escape(self._readonly_why(self.control_reason))}; "
                         "s and q are off")

    def _readonly_why(self, reason: str) -> str:
        status = self.state.status
        if status in ("finished", "stopped", "failed"):
            return f"this run is {status} (step {self.state.step})"
        return reason

    def _exit_how(self) -> str:
        code = self.engine_exit
        if code is None:
            return "running"
        return f"killed by signal {-code}" if code < 0 else f"exit status {code}"

    def _engine_exited(self, code: int) -> None:
        self.engine_exit = code
        if code == 2 and self._engine_json_pid() != self.proc.pid:
            # Refused before it wrote engine.json (bad input, lock held...): nothing to watch.
            lines = tail_text(self.reader.paths.log, 10)
            errors = [x for x in lines if x.startswith("error: ")]
            self.engine_error = (errors or lines or [
                "error: the engine exited with status 2 before it started"])[-1]
            self.exit(None)
            return
        if self.stopping_since is not None:
            return  # the expected end of `q`; _tick exits the app
        lines = tail_text(self.reader.paths.log, 10)
        after = "; q quits (andrea-tui exits 1)" if code != 0 else ""
        self._banner(f"[b]engine ended: {self._exit_how()}[/b] (status {self.state.status})"
                     f"{after}; last log lines:\n" + "\n".join(escape(x) for x in lines), error=code != 0)
        self._update_panels()

    def _tick(self) -> None:
        self.poll_now()
        self._check_engine()
        self._request_panels()  # elapsed and ETA move with the clock
        if self.stopping_since is None:
            return
        gone = (self.engine_exit is not None if self.proc is not None
                else not self.controllable)
        if gone:
            self.poll_now()
            self.exit(self._stop_summary())
        elif not self.force_asked and time.monotonic() - self.stopping_since > self.stop_timeout:
            self.force_asked = True
            self.notify(f"the engine did not stop within {self.stop_timeout:.0f} s",
                        severity="warning")
            self.push_screen(ForceStopScreen(self.stop_timeout), self._force_answer)

    def _stop_summary(self) -> str:
        st = self.state
        if self.proc is not None and self._engine_json_pid() != self.proc.pid:
            return (f"engine stopped before it started ({self._exit_how()}); "
                    f"see {self.reader.paths.log}")
        lc = st.last_checkpoint
        code = "" if self.engine_exit is None else f", engine exit status {self.engine_exit}"
        ck = f"; last checkpoint {lc.path} (step {lc.step})" if lc else ""
        return f"{st.name}: {st.status} at step {st.step}{code}{ck}"

    def _force_answer(self, force: bool | None) -> None:
        if not force:
            self.force_asked = False
            self.stopping_since = time.monotonic()  # wait another full timeout
            return
        if self._stop_deferred and self.proc is not None and self.engine_exit is None:
            self.proc.kill()  # our unreaped child, never verified: Popen cannot hit another pid
            return
        self._send(signal.SIGKILL, "force stop")

    def _send(self, sig: int, what: str) -> bool:
        if self.proc is not None and not self._ours():
            self.notify(f"{what}: not sent: the engine of {self.run_dir} is not the one this app "
                        "started", severity="error")
            return False
        try:
            signal_engine(self.run_dir, sig)
        except ControlRefused as e:
            self.notify(f"{what}: not sent: {e}", severity="error")
            return False
        return True

    def _announce_checkpoints(self) -> None:
        cks = self.state.checkpoints
        for ev in cks[self._ckpt_seen:]:
            if ev.reason in ("snapshot", "stop") or self._snapshot_pending:
                self.notify(f"checkpoint step {ev.step} ({ev.reason}): "
                            f"{ev.path} in {panels.fmt_num(ev.seconds)} s",
                            title="checkpoint written")
            if ev.reason == "snapshot":
                self._snapshot_pending = False
        self._ckpt_seen = len(cks)

    # ------------------------------------------------------------ keys

    def _recheck(self) -> None:
        """A key came before the next control tick: the engine may have become reachable
        since the last one (steps show up before the tick notices engine.json)."""
        if not self.controllable and self.engine_exit is None:
            self._check_engine()

    def action_snapshot(self) -> None:
        self._recheck()
        if not self.controllable:
            self.notify(f"snapshot is off: {self._readonly_why(self.control_reason)}",
                        severity="warning")
            return
        if self._send(signal.SIGUSR1, "snapshot"):
            self._snapshot_pending = True
            self.notify("SIGUSR1 sent: snapshot at the next step boundary")

    def action_stop(self) -> None:
        if self.stopping_since is not None:
            self.notify("already stopping; waiting for the stop checkpoint")
            return
        self._recheck()
        if not self.controllable:
            if self.proc is not None and self.engine_exit is None:
                # Our own child, still starting: a SIGTERM now could come before its handlers
                # exist and kill it without a checkpoint. Send it once engine.json names it.
                self._stop_deferred = True
                self.notify("stop requested: sent as soon as the engine has started")
            else:
                self.exit(f"closed {self.run_dir} (read-only: "
                          f"{self._readonly_why(self.control_reason)})")
                return
        elif not self._send(signal.SIGTERM, "stop"):
            return
        self.stopping_since = time.monotonic()
        self._update_panels()

    def action_detach(self) -> None:
        if self.controllable or (self.proc is not None and self.engine_exit is None):
            self.exit(f"engine keeps running. Reattach with:\n  andrea-tui attach {self.run_dir}")
        else:
            self.exit(f"closed {self.run_dir} (no engine running)")

    def action_checkpoints(self) -> None:
        from andrea_tui.ckpt_screens import CheckpointListScreen

        self.push_screen(CheckpointListScreen(self.run_dir))

    def action_log(self) -> None:
        self.push_screen(LogScreen(self.reader.paths.log))

    def action_help(self) -> None:
        self.push_screen(HelpScreen(LAST_N))

    def action_toggle_log_y(self) -> None:
        chart = self._widget("loss")
        chart.log_y = not chart.log_y
        self._redraw_charts()

    def action_toggle_window(self) -> None:
        for chart in self._charts():
            chart.last_n = None if chart.last_n else LAST_N
        self._redraw_charts()
