"""The dashboard's text panels as Rich Text, built from a RunState (no widgets here).

Kept apart from the widgets so tests can check the values on a panel without a screen.
"""

from __future__ import annotations

import math
import re
import time
from pathlib import Path
from typing import Any

from rich.markup import escape
from rich.text import Text

from andrea_tui.runstate import RunState, peak_flops
from andrea_tui.textfmt import (
    LOSS_WIDTH,
    as_number,
    bar,
    fmt_bytes,
    fmt_clip,
    fmt_duration,
    fmt_grad,
    fmt_int,
    fmt_loss,
    fmt_lr,
    fmt_ms,
    fmt_num,
    fmt_pct,
    fmt_rate,
    fmt_tokens,
    fmt_weight,
)
from engine import records as rec

STATUS_STYLE = {"starting": "yellow", "running": "green", "stopping": "yellow",
                "stopped": "blue", "finished": "blue", "failed": "bold red"}


def clock(t: Any) -> str:
    t = as_number(t)
    if t is None or not math.isfinite(t):
        return "--:--:--"
    try:
        return time.strftime("%H:%M:%S", time.localtime(t))
    except (OverflowError, OSError, ValueError):  # a time no calendar holds
        return "--:--:--"


def header(st: RunState, now: float, note: str = "", dead: bool = False,
           halted: bool = False, narrow: bool = False) -> Text:
    """`dead`: no engine behind a run its files call live: elapsed stops at the last record
    and there is no ETA. `halted`: the engine is frozen or stalled (`note` says which and for
    how long): no tok/s and no ETA, which would describe steps that are not coming, and no
    health word of the engine's (a frozen engine judges nothing: the viewer's word stands).
    `narrow`: the few items that matter most (a terminal under 100 columns)."""
    status = note or st.status
    if dead:
        last_t = as_number(st.series.last("t")) if st.series.n else None
        now = last_t if last_t is not None else st.updated or now
    style = ("bold red" if dead else HALTED_STYLE if halted
             else STATUS_STYLE.get(st.status, "bold"))
    step = st.step
    attention = st.ready.attention.split(" ", 1)[0] if st.ready and st.ready.attention else ""
    device = (f"{escape(st.backend)}/{escape(st.device)}"
              + (f" ×{st.world_size}" if st.world_size > 1 else "")
              + (f" attn {escape(attention)}" if attention else "")
              + (f" fp8 {len(st.ready.fp8_gemms)} GEMMs" if st.ready and st.ready.fp8_gemms
                 else ""))
    health = None if halted else health_markup(st)
    n_alerts = st.alerts_seen
    alerts = (f"[bold yellow]alerts {n_alerts}[/]" if n_alerts else f"alerts {n_alerts}")
    parts = [
        f"[bold]{escape(st.name)}[/]",
        *([] if narrow else [device]),
        f"[{style}]{escape(status)}[/]",
        *([health] if health else []),
        f"step [bold]{fmt_int(step)}[/]/{fmt_int(st.max_steps)}",
        alerts,
        *([] if narrow else [f"tokens {fmt_tokens(st.tokens).strip()}"]),
        *([] if halted else [f"{fmt_rate(st.smooth_tok_s()).strip()} tok/s"
                             + ("" if narrow else mfu_text(st))]),
        *([] if narrow else [f"elapsed {fmt_duration(st.elapsed(now))}"]),
        *([] if halted else [f"ETA {fmt_duration(None if dead else st.eta())}"]),
    ]
    return Text.from_markup(" · ".join(parts))


HEALTH_STYLE = {rec.Health.HEALTHY: "bold green", rec.Health.WARNING: "bold yellow",
                rec.Health.DIVERGING: "bold red", rec.Health.STALLED: "bold magenta",
                rec.Health.FAILED: "bold red"}
HALTED_STYLE = "bold magenta"  # the viewer's own frozen or stalled judgement


def health_markup(st: RunState) -> str:
    """The engine's health word for the header, in its colour (`warning since step 500`);
    "" before the engine has judged the run."""
    h = st.health
    if h is None:
        return ""
    since = f" since step {fmt_int(h.step)}" if h.step is not None \
        and h.state != rec.Health.HEALTHY else ""
    return f"[{HEALTH_STYLE[h.state]}]{h.state.value}{since}[/]"


def health_line(st: RunState) -> Text | None:
    """The health state with its reason, for the top of the events panel; None while the
    engine has said nothing, and while it says healthy with nothing to add."""
    h = st.health
    if h is None or (h.state == rec.Health.HEALTHY and not h.reason):
        return None
    text = Text("health ", style="bold")
    text.append(h.state.value, style=HEALTH_STYLE[h.state])
    if h.step is not None:
        text.append(f" since step {fmt_int(h.step)}")
    if h.reason:
        text.append(f": {h.reason}")
    return text


def mfu_text(st: RunState) -> str:
    """` · MFU 41%` when the GPU's peak is known, else nothing."""
    mfu = st.mfu()
    return f" · MFU {fmt_pct(100 * mfu).strip()}" if mfu is not None else ""


LABEL = 10  # the training panel's label column
CLIP_WINDOW = 100  # the share of clipped steps is over this many of the newest


def training(st: RunState) -> Text:
    """Loss (smoothed, the headline, with the step's own beside it), validation loss, grad
    norm against the clip line, clip scale, lr, step time, skipped steps, last checkpoint.
    Every number in its quantity's format (textfmt): the columns hold still between frames."""
    s = st.series
    ema = s.ema()
    smooth = float(ema[-1]) if len(ema) and s.ema_alpha else None
    raw = s.last("loss")
    ev = st.val_loss
    lines = [
        (f"{'loss EMA':<{LABEL}}{fmt_loss(smooth)}  raw {fmt_loss(raw)}" if smooth is not None
         else f"{'loss':<{LABEL}}{fmt_loss(raw)}"),
        *([f"{'val loss':<{LABEL}}{fmt_loss(ev.val_loss)}  at step {fmt_int(ev.step)}"]
          if ev else []),
        f"{'grad norm':<{LABEL}}{fmt_grad(s.last('grad_norm'))}  clip at "
        f"{fmt_grad(st.max_grad_norm).strip()}",
        f"{'clip scale':<{LABEL}} {fmt_clip(s.last('clip_scale'))}  "
        f"{fmt_pct(100 * s.clip_share(CLIP_WINDOW)).strip()} clipped",
        f"{'lr':<{LABEL - 2}}{fmt_lr(s.last('lr'))}",
        f"{'step time':<{LABEL}} {fmt_ms(s.last('step_ms'))} ms",
    ]
    text = Text("\n".join(lines))
    skipped = s.skipped_count()
    text.append(f"\n{'skipped':<{LABEL}}")
    text.append(f"{skipped} non-finite step(s)" if skipped else "0",
                style="bold red" if skipped else "")
    lc = st.last_checkpoint
    if lc:
        text.append(f"\n{'ckpt':<{LABEL}}step {fmt_int(lc.step)} {lc.reason} "
                    f"{Path(lc.path).name}")
    for line, bad in ranks_lines(st):
        text.append("\n" + line, style="bold red" if bad else "")
    if st.skipped_lines:
        text.append(f"\n{st.skipped_lines} corrupt line(s) skipped", style="yellow")
    text.no_wrap, text.overflow = True, "ellipsis"
    return text


BEHIND = 1.25  # a rank whose step takes this much longer than the fastest's is falling behind


def ranks_lines(st: RunState) -> list[tuple[str, bool]]:
    """A data-parallel job's ranks: each one's device and tok/s, a rank that falls behind or
    ended. (line, is it bad news)"""
    if st.world_size <= 1:
        return []
    last = st.last_record
    ms = last.rank_ms if last is not None else []
    per_rank = (st.ready.tokens_per_step or 0) / st.world_size if st.ready else 0
    devices = {r.rank: r.device for r in st.engine.ranks} if st.engine else {}
    fastest = min(ms) if ms else math.nan
    dead = {int(m.split()[1]) for m in st.errors
            if m.startswith("rank ") and m.split()[1].isdigit()}
    out = []
    for r in range(st.world_size):
        t = ms[r] if r < len(ms) else math.nan
        tok_s = per_rank / (t / 1e3) if t and math.isfinite(t) and t > 0 else math.nan
        note = " ended" if r in dead else (" behind" if t > BEHIND * fastest else "")
        out.append((f"rank {r:<3} {devices.get(r, '?'):<8} {fmt_rate(tok_s)} tok/s"
                    f"  {fmt_ms(t)} ms{note}", bool(note)))
    return out


def bandit(st: RunState, bar_width: int = 10, src_loss: dict[str, float] | None = None,
           name_width: int = 18) -> Text:
    """Phase, mixture weights and per-source loss (`src_loss`: the values to show, if not the
    latest ones); source names cut to `name_width`."""
    src_loss = st.src_loss if src_loss is None else src_loss
    r = st.last_record
    phase, pstep, plen = (r.phase, r.phase_step, r.phase_len) if r else (None, None, None)
    text = Text.from_markup(
        f"[bold]phase {fmt_int(phase)}[/] · step {fmt_int(pstep)}/{fmt_int(plen)}"
    )
    if st.phase_changes:
        pc = st.phase_changes[-1]
        recent = st.step is not None and st.step - pc.step < 3
        text.append(f" · began at step {pc.step}",
                    style="bold reverse magenta" if recent else "magenta")
    weights = r.weights if r else {}
    name_w = min(max((len(n) for n in weights), default=0), name_width)
    ev = st.val_loss
    if ev:
        bar_width = max(2, bar_width - 5)  # room for the validation column
    if weights:
        text.append(f"\n{'':<{name_w}} {'weight':<{bar_width + 5}} {'train':>{LOSS_WIDTH}}"
                    + (f" {'val':>{LOSS_WIDTH}}" if ev else ""), style="dim")
    for name, w in weights.items():
        loss = src_loss.get(name)
        text.append(f"\n{name[:name_w]:<{name_w}} ")
        text.append(bar(w, bar_width), style="cyan")
        text.append(f" {fmt_weight(w):>4} {fmt_loss(loss)}")
        if ev:
            text.append(f" {fmt_loss(ev.src_val_loss.get(name))}", style="yellow")
    text.no_wrap, text.overflow = True, "ellipsis"
    return text


SYSTEM_STALE_S = 30.0  # a telemetry sample older than this (by the engine's clock) is dimmed


def system(st: RunState, now: float) -> Text:
    """Telemetry (system.jsonl) beside the memory plan: per GPU its utilization, memory used
    against the plan's total, power, temperature and SM clock; the engine's CPU use and RSS;
    the model FLOPs utilization."""
    plan = st.memory_plan
    total = plan.get("total")
    n = st.ready.n_params if st.ready else None
    text = Text(f"params {fmt_int(n)} · plan {fmt_bytes(total) if total else '–'}")
    sysrec = st.system
    if sysrec is None:
        text.append("\nno telemetry yet (system.jsonl)", style="dim")
        return text
    stale = st.live and now - sysrec.t > SYSTEM_STALE_S
    for g in sysrec.gpus:
        name = g.name.replace("NVIDIA ", "")[:14] or "gpu"
        text.append(f"\ngpu{g.index} {name} {fmt_pct(g.util).strip()} · {fmt_num(g.temp_c, 3)}°C · "
                    f"{fmt_num(g.power_w, 3)} W · {fmt_int(g.sm_clock_mhz).replace(',', '')} MHz")
        text.append(f"\n  mem {fmt_bytes(g.mem_used)} / {fmt_bytes(g.mem_total)}"
                    + (f" (plan {fmt_bytes(total)})" if total else ""))
    text.append(f"\ncpu {fmt_pct(sysrec.cpu_pct).strip()} of a core · "
                f"rss {fmt_bytes(sysrec.rss_bytes)}")
    mfu = st.mfu()
    if mfu is not None:
        text.append(f"\nMFU {fmt_pct(100 * mfu).strip()} of {st.gpu_name} bf16 peak")
    else:
        why = "model size" if peak_flops(st.gpu_name) else "peak of this device"
        text.append(f"\nMFU – ({why} unknown)", style="dim")
    if stale:
        text.append(f"\nlast sample {fmt_duration(now - sysrec.t)} ago", style="yellow")
    return text


def sample(st: RunState) -> Text:
    s = st.last_sample
    if not s:
        return Text("no sample yet", style="dim")
    text = Text(f"step {fmt_int(s.step)} · ", style="bold")
    text.append(repr(s.prompt), style="cyan")
    text.append(" → ")
    text.append(s.text.replace("\n", "⏎ "))
    return text


def event_line(e: rec.Event) -> str:
    if isinstance(e, rec.CheckpointEvent):
        detail = (f"step {e.step} {e.reason} {Path(e.path).name} "
                  f"({fmt_bytes(e.bytes)}, {fmt_num(e.seconds)} s)")
    elif isinstance(e, rec.ReadyEvent):
        detail = f"{e.backend}/{e.device} params {fmt_int(e.n_params)}"
    elif isinstance(e, rec.StartEvent):
        detail = f"pid {e.pid} resumed={e.resumed}"
    elif isinstance(e, (rec.PrepEvent, rec.ErrorEvent)):
        detail = e.message
    elif isinstance(e, rec.AlertEvent):
        return f"{clock(e.t)} alert {e.alert}: {e.message}"
    elif isinstance(e, rec.MixtureEvent):
        return (f"{clock(e.t)} mixture moved at step {fmt_int(e.step)}: " + ", ".join(
            f"{n} {fmt_weight(a).strip()} → {fmt_weight(b).strip()}" for n, a, b in e.moves()))
    elif isinstance(e, rec.HealthEvent):
        at = f" at step {fmt_int(e.step)}" if e.step is not None else ""
        return f"{clock(e.t)} health {e.state.value}{at}" + (f": {e.reason}" if e.reason else "")
    else:
        detail = " ".join(f"{k}={v}" for k, v in e.details().items()
                          if not isinstance(v, (dict, list)))
    return f"{clock(e.t)} {e.kind} {detail}"


EVENT_STYLE = {rec.AlertEvent: "bold red", rec.MixtureEvent: "cyan"}
# Every bandit phase is an event; the events panel leaves them to the data mixture panel and
# the events screen, and shows the mixture's moves (MixtureEvent) instead.
PANEL_SKIPS = (rec.PhaseEvent,)


def _event_style(e: rec.Event) -> str:
    if isinstance(e, rec.HealthEvent):
        return HEALTH_STYLE[e.state]
    return EVENT_STYLE.get(type(e), "")


def events(st: RunState, n: int) -> Text:
    """The newest `n` events, under the engine's health state and its reason when there is
    something to say (health_line)."""
    head = health_line(st)
    shown = [e for e in st.events if not isinstance(e, PANEL_SKIPS)]
    evs = shown[-(n - 1 if head else n):] if n > 0 else []
    if not evs and head is None:
        return Text("no events yet" if not st.events else
                    "only the bandit's phases lately (v: every event)", style="dim")
    text = Text(no_wrap=True, overflow="ellipsis")
    if head is not None:
        text.append_text(head)
    for i, e in enumerate(evs):
        text.append(("\n" if i or head is not None else "") + event_line(e),
                    style=_event_style(e))
    return text


def all_events(st: RunState) -> Text:
    """Every event the dashboard holds, oldest first, under the health line (the events
    screen: its lines wrap)."""
    text = Text()
    head = health_line(st)
    if head is not None:
        text.append_text(head)
        text.append("\n")
    if not st.events:
        text.append("no events yet", style="dim")
    for i, e in enumerate(st.events):
        text.append(("\n" if i else "") + event_line(e), style=_event_style(e))
    return text


# ---------------------------------------------------------------- collapsed panels


def summaries(st: RunState, log_lines: list[str]) -> dict[str, Text]:
    """One line for each panel a small terminal has no room for (events, engine.log, latest
    sample, system), each led by the key that opens it in full."""
    out: dict[str, Text] = {}
    text = _key_line("v", "events")
    n = st.alerts_seen
    text.append(f"{n} alert{'' if n == 1 else 's'}", style="bold yellow" if n else "")
    h = st.health
    if h is not None and h.state != rec.Health.HEALTHY:
        text.append(" · ")
        text.append(h.state.value, style=HEALTH_STYLE[h.state])
        text.append(f": {h.reason}" if h.reason else "")
    elif st.alerts:
        a = st.alerts[-1]
        text.append(f", last {a.alert.replace('_', ' ')} at step {fmt_int(a.step)}")
    else:
        last = next((e for e in reversed(st.events) if not isinstance(e, PANEL_SKIPS)), None)
        if last is not None:
            text.append(f", last {last.kind}")
    out["events"] = text
    text = _key_line("l", "engine.log")
    text.append(log_lines[-1] if log_lines else "(empty)")
    out["log"] = text
    text = _key_line("p", "sample")
    s = st.last_sample
    if s:
        text.append(f"step {fmt_int(s.step)} {s.prompt!r} → {s.text.replace(chr(10), '⏎ ')}")
    else:
        text.append("none yet", style="dim")
    out["sample"] = text
    text = _key_line("i", "system")
    sysrec = st.system
    parts = [f"params {fmt_int(st.ready.n_params)}"] if st.ready and st.ready.n_params else []
    if sysrec is not None:
        parts += [f"gpu{g.index} {fmt_pct(g.util).strip()}" for g in sysrec.gpus[:2]]
        parts += [f"cpu {fmt_pct(sysrec.cpu_pct).strip()}", f"rss {fmt_bytes(sysrec.rss_bytes)}"]
    text.append(" · ".join(parts) or "no telemetry yet")
    out["system"] = text
    for t in out.values():
        t.no_wrap, t.overflow = True, "ellipsis"
    return out


def _key_line(key: str, name: str) -> Text:
    text = Text()
    text.append(key, style="reverse bold")
    text.append(f" {name}: ", style="bold")
    return text


# engine.log lines that say what an event of the events panel says already
EVENT_ECHO = re.compile(r"^\d\d:\d\d:\d\d (checkpoint \w+ step \d+:|prep: |SIG\w+ |alert |"
                        r"step \d+: non-finite|resume: from )")


def log_tail(lines: list[str], n: int) -> list[str]:
    """The last `n` lines of engine.log worth a panel beside the events: lines that echo an
    event are left out (the full log, `l`, has them all), and a line repeated back to back
    shows once with its count."""
    out: list[str] = []
    counts: list[int] = []
    for line in lines:
        if EVENT_ECHO.match(line):
            continue
        if out and line[9:] == out[-1][9:] and line[9:]:
            counts[-1] += 1
            out[-1] = line
            continue
        out.append(line)
        counts.append(1)
    shown = [f"{x} (×{c})" if c > 1 else x for x, c in zip(out, counts, strict=True)]
    return shown[-n:] if n > 0 else []
