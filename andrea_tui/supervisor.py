"""The engine of one run directory as the dashboard sees it: alive, ours, ended, stopping.

Headless (no Textual), so tests drive it with a real engine process and no screen. It decides;
the app shows: requests (`snapshot`, `stop`, `detach`, the force-stop answer) return an
`Outcome`, and `check()` returns an `EngineCheck` saying what the banner should read now. Texts
meant for the banner are Rich markup; toast texts are plain.

Signals go only through engine.run.control.signal_engine, which verifies the pid, its start time,
boot id and engine.lock before every signal (DESIGN §8); when this app launched the engine, a
signal is sent only while engine.json names the very process it started. The one exception is a
force stop before that process ever wrote engine.json: Popen.kill on our own unreaped child,
which cannot reach another process.
"""

from __future__ import annotations

import math
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from rich.markup import escape

from andrea_tui.runstate import RunState
from andrea_tui.textfmt import fmt_int, fmt_num
from engine.run.control import ControlRefused, engine_alive, signal_engine
from engine.run.identity import proc_state, read_engine_info
from engine.runfiles import RunPaths, tail_text

ENDED_STATUSES = ("finished", "stopped", "failed")
SUMMARY_REASON_CHARS = 300  # the health reason in the exit line, at most
FROZEN_STATES = {"T": "SIGSTOP", "t": "stopped by a debugger"}  # /proc/PID/stat field 3
Severity = Literal["information", "warning", "error"]  # as Textual's notify takes them


@dataclass(frozen=True)
class Outcome:
    """What a request came to. `message` is for a toast ("" says nothing), with Textual's
    notify severity; `close`, when set, is the text the app ends with."""

    ok: bool
    message: str = ""
    severity: Severity = "information"
    close: str | None = None


@dataclass(frozen=True)
class Banner:
    """The dashboard's banner line(s): Rich markup, "" hides it; `error` colours it red."""

    text: str
    error: bool = False


@dataclass(frozen=True)
class EngineCheck:
    """What one `EngineSupervisor.check()` found.

    exited: the launched engine was seen to end during this check.
    refused: it ended having refused to start (`engine_error` holds its line): nothing to watch.
    banner: what the banner should say now; None leaves it as it is.
    stop: the deferred stop, when this check sent it (or failed to)."""

    exited: bool = False
    refused: bool = False
    banner: Banner | None = None
    stop: Outcome | None = None


class EngineSupervisor:
    """Engine lifecycle and control for one run directory. `proc` is the engine when the app
    launched it (launch mode); without it the app attached to whatever runs there."""

    def __init__(self, run_dir: Path, proc: subprocess.Popen | None = None,
                 stop_timeout: float = 120.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.run_dir = Path(run_dir)
        self.paths = RunPaths(self.run_dir)
        self.proc = proc
        self.stop_timeout = stop_timeout
        self._clock = clock
        self.controllable = False  # a verified engine, ours in launch mode, takes signals
        self.reason = "checking the engine…"  # why not, when it does not
        self.engine_exit: int | None = None  # the launched engine's exit status
        self.engine_error: str | None = None  # its error line when it refused to start
        self.stopping_since: float | None = None  # `q` accepted at this clock time
        self.stop_deferred = False  # `q` came before the launched engine could take a signal
        self.force_asked = False  # the stop timed out and the user is being asked
        self._snapshot_pending = False
        self._checkpoints_seen = 0
        self.frozen = ""  # "frozen (SIGSTOP)" while the engine's process is stopped, else ""
        self.frozen_pid: int | None = None  # that process

    # ------------------------------------------------------------ looking

    def check(self, state: RunState) -> EngineCheck:
        """Find out whether the engine is alive and controllable (and why not), notice the
        launched engine's end, and send a deferred stop once the engine can take it."""
        alive, reason = engine_alive(self.run_dir)
        exited = self._poll_exit()
        banner = None
        if exited and self.engine_error is None and self.stopping_since is None:
            banner = self._ended_banner(state)  # an end nobody asked for: say how, show the log
        if self.proc is not None and alive and not self.ours():
            alive = False
            reason = (f"the engine running here is not the one this app started (pid "
                      f"{self.proc.pid})")
        self.controllable = alive
        self.frozen, self.frozen_pid = self._frozen() if alive else ("", None)
        stop = None
        if self.stop_deferred and alive:
            self.stop_deferred = False  # its handlers exist now: stop it the verified way
            stop = self._send(signal.SIGTERM, "stop")
            if stop.ok:
                self.stopping_since = self._clock()
        # Messages name files by full path; inside this run directory the file name is enough.
        self.reason = reason.replace(f"{self.run_dir}/", "")
        if self.engine_exit is None:
            banner = self._reachability_banner(state)
        return EngineCheck(exited=exited, refused=exited and self.engine_error is not None,
                           banner=banner, stop=stop)

    def ours(self) -> bool:
        """Launch mode: the engine of this run directory is the process we started and it is
        still alive (a refused launch must never steer somebody else's engine)."""
        return (self.proc is not None and self.proc.poll() is None
                and self._engine_json_pid() == self.proc.pid)

    def may_have_become_reachable(self) -> bool:
        """Worth a check before acting on a key: steps show up before the control tick notices
        engine.json, so an engine not controllable a moment ago may be now."""
        return not self.controllable and self.engine_exit is None

    def engine_dead(self, run_live: bool, history_loaded: bool) -> bool:
        """The run's files say it is live (`run_live`) but no engine is: attach mode with no
        verified engine once the history is in, or the launched process has exited."""
        if not run_live:
            return False
        if self.proc is not None:
            return self.engine_exit is not None
        return not self.controllable and history_loaded

    def note(self, state: RunState, history_loaded: bool) -> str:
        """The engine's word for the header ("" when it has none to add)."""
        if self.stop_deferred:
            return "stopping… (waiting for the engine to start)"
        if self.frozen and self.engine_exit is None:
            return self.frozen if self.stopping_since is None else f"stopping… ({self.frozen})"
        if self.stopping_since is not None:
            return "stopping… (waiting for the stop checkpoint)"
        if self.engine_exit is not None and self.proc is not None:
            return f"engine ended: {self.exit_how()}"
        if self.engine_dead(state.live, history_loaded):
            return f"dead (state.json says {state.status})"
        return ""

    def readonly_why(self, state: RunState) -> str:
        """Why s and q are off, in the run's terms when it has ended."""
        if state.status in ENDED_STATUSES:
            return f"this run is {state.status} (step {fmt_int(state.step)})"
        return self.reason

    def exit_how(self) -> str:
        code = self.engine_exit
        if code is None:
            return "running"
        return f"killed by signal {-code}" if code < 0 else f"exit status {code}"

    @property
    def exit_status(self) -> int:
        """The status `andrea-tui` exits with: 2 when the launched engine refused its input,
        1 when it failed, else 0 (attach mode, a graceful stop, an engine left running)."""
        if self.proc is not None and self.engine_exit is None:
            code = self.proc.poll()
            if code is not None:
                self.engine_exit = code
        if self.engine_error is not None:
            return 2  # the engine refused its input before it started: a usage error
        return 1 if self.proc is not None and self.engine_exit not in (None, 0) else 0

    def checkpoint_news(self, state: RunState, since: float = -math.inf) -> list[str]:
        """Toast texts for the checkpoints written since the last call that the user waits
        for: snapshot and stop checkpoints, and any checkpoint while a snapshot is pending.
        Checkpoints written before `since` (an attach reading a run's history) are not news."""
        cks = state.checkpoints
        news = []
        for ev in cks[self._checkpoints_seen:]:
            if math.isfinite(ev.t) and ev.t < since:
                continue
            if ev.reason in ("snapshot", "stop") or self._snapshot_pending:
                news.append(f"checkpoint step {ev.step} ({ev.reason}): "
                            f"{ev.path} in {fmt_num(ev.seconds)} s")
            if ev.reason == "snapshot":
                self._snapshot_pending = False
        self._checkpoints_seen = len(cks)
        return news

    # ------------------------------------------------------------ steering

    def snapshot(self, state: RunState) -> Outcome:
        """SIGUSR1: a snapshot checkpoint at the next step boundary."""
        if not self.controllable:
            return Outcome(False, f"snapshot is off: {self.readonly_why(state)}", "warning")
        sent = self._send(signal.SIGUSR1, "snapshot")
        if not sent.ok:
            return sent
        self._snapshot_pending = True
        return Outcome(True, "SIGUSR1 sent: snapshot at the next step boundary")

    def stop(self, state: RunState) -> Outcome:
        """SIGTERM: the engine writes a stop checkpoint and exits. Deferred while our own child
        is still starting (a SIGTERM before its handlers exist would kill it without a
        checkpoint); with no engine to stop, the outcome closes the app."""
        if self.stopping_since is not None:
            return Outcome(False, "already stopping; waiting for the stop checkpoint")
        if not self.controllable:
            if self.proc is None or self.engine_exit is not None:
                return Outcome(False, close=f"closed {self.run_dir} (read-only: "
                               f"{self.readonly_why(state)})" + health_words(state, "; "))
            self.stop_deferred = True  # sent by check() once engine.json names our child
            self.stopping_since = self._clock()
            return Outcome(True, "stop requested: sent as soon as the engine has started")
        sent = self._send(signal.SIGTERM, "stop")
        if sent.ok:
            self.stopping_since = self._clock()
        return sent

    def stop_done(self) -> bool:
        """A stop was asked for and the engine has gone."""
        if self.stopping_since is None:
            return False
        return self.engine_exit is not None if self.proc is not None else not self.controllable

    def stop_overdue(self) -> Outcome | None:
        """Once per wait: the engine has not stopped within stop_timeout, so the user should be
        asked whether to force it (then `answer_force`). None while there is nothing to ask."""
        if (self.stopping_since is None or self.force_asked
                or self._clock() - self.stopping_since <= self.stop_timeout):
            return None
        self.force_asked = True
        return Outcome(False, f"the engine did not stop within {self.stop_timeout:.0f} s",
                       "warning")

    def answer_force(self, force: bool | None) -> Outcome:
        """The user's answer to `stop_overdue`: SIGKILL, or wait another full stop_timeout."""
        if not force:
            self.force_asked = False
            self.stopping_since = self._clock()
            return Outcome(True)
        if self.stop_deferred and self.proc is not None and self.engine_exit is None:
            self.proc.kill()  # our unreaped child, never verified: Popen cannot hit another pid
            return Outcome(True)
        return self._send(signal.SIGKILL, "force stop")

    def detach(self, state: RunState | None = None) -> Outcome:
        """Leave: the engine keeps running (and how to come back), or there was none; the
        run's health as the engine last judged it, when it did (`state`)."""
        health = health_words(state, "; ") if state is not None else ""
        if self.controllable or (self.proc is not None and self.engine_exit is None):
            return Outcome(True, close=f"engine keeps running{health}. Reattach with:\n"
                           f"  andrea-tui attach {self.run_dir}")
        return Outcome(True, close=f"closed {self.run_dir} (no engine running){health}")

    def stop_summary(self, state: RunState) -> str:
        """The line the app ends with after a stop."""
        if self.proc is not None and self._engine_json_pid() != self.proc.pid:
            return (f"engine stopped before it started ({self.exit_how()}); "
                    f"see {self.paths.log}")
        lc = state.last_checkpoint
        code = "" if self.engine_exit is None else f", engine exit status {self.engine_exit}"
        ck = f"; last checkpoint {lc.path} (step {fmt_int(lc.step)})" if lc else ""
        return (f"{state.name}: {state.status} at step {fmt_int(state.step)}{code}{ck}"
                + health_words(state, "; "))

    # ------------------------------------------------------------ inside

    def _frozen(self) -> tuple[str, int | None]:
        """Whether the verified engine's process (or a rank of its job on this host) is stopped
        (SIGSTOP, Ctrl+Z, a debugger): its watchdog is then frozen with it and says nothing.
        ("frozen (SIGSTOP)", that pid) or ("", None)."""
        info = read_engine_info(self.paths.root)
        if not info:
            return "", None
        procs = [("", info.pid)] + [(f"rank {r.rank} ", r.pid) for r in info.ranks
                                    if r.pid != info.pid and r.host in ("", info.host)]
        for who, pid in procs:
            why = FROZEN_STATES.get(proc_state(pid) or "")
            if why:
                return f"{who}frozen ({why})", pid
        return "", None

    def _engine_json_pid(self) -> int | None:
        info = read_engine_info(self.paths.root)
        return info.pid if info else None

    def _poll_exit(self) -> bool:
        """True when the launched engine is seen to have exited for the first time; a status 2
        before it wrote engine.json is a refused start (bad input, lock held...)."""
        if self.proc is None or self.engine_exit is not None:
            return False
        code = self.proc.poll()
        if code is None:
            return False
        self.engine_exit = code
        if code == 2 and self._engine_json_pid() != self.proc.pid:
            lines = tail_text(self.paths.log, 10)
            errors = [x for x in lines if x.startswith("error: ")]
            self.engine_error = (errors or lines or [
                "error: the engine exited with status 2 before it started"])[-1]
        return True

    def _send(self, sig: int, what: str) -> Outcome:
        if self.proc is not None and not self.ours():
            return Outcome(False, f"{what}: not sent: the engine of {self.run_dir} is not the one "
                           "this app started", "error")
        try:
            signal_engine(self.run_dir, sig)
        except ControlRefused as e:
            return Outcome(False, f"{what}: not sent: {e}", "error")
        return Outcome(True)

    def _ended_banner(self, state: RunState) -> Banner:
        code = self.engine_exit
        lines = tail_text(self.paths.log, 10)
        after = "; q quits (andrea-tui exits 1)" if code != 0 else ""
        return Banner(f"[b]engine ended: {self.exit_how()}[/b] (status {state.status}){after}; "
                      "last log lines:\n" + "\n".join(escape(x) for x in lines), error=code != 0)

    def _reachability_banner(self, state: RunState) -> Banner:
        if self.controllable:
            return Banner("")
        if self.proc is not None:
            # Until our child has written engine.json, the run's files are the previous engine's
            # (a resume): it is starting, not unreachable.
            starting = state.status == "starting" or (
                self.proc.poll() is None and self._engine_json_pid() != self.proc.pid)
            return Banner("engine starting…" if starting
                          else f"engine not reachable: {escape(self.reason)}")
        return Banner(f"read-only: {escape(self.readonly_why(state))}; s and q are off")


def health_words(state: RunState, lead: str = "") -> str:
    """The run's health as the engine last judged it, for the line the app ends with:
    `health diverging since step 2: <reason>`, after `lead`; "" when it never judged."""
    h = state.health
    if h is None:
        return ""
    since = f" since step {fmt_int(h.step)}" if h.step is not None \
        and h.state.value != "healthy" else ""
    reason = h.reason if len(h.reason) <= SUMMARY_REASON_CHARS else \
        h.reason[:SUMMARY_REASON_CHARS - 1] + "…"
    return f"{lead}health {h.state.value}{since}" + (f": {reason}" if reason else "")
