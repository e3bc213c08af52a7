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
from andrea_tui.textfmt import as_number, bar, fmt_bytes, fmt_duration, fmt_int, fmt_num
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
           halted: bool = False) -> Text:
    """`dead`: no engine behind a run its files call live: elapsed stops at the last record
    and there is no ETA. `halted`: the engine is frozen or stalled (`note` says which and for
    how long): no tok/s and no ETA, which would describe steps that are not coming."""
    status = note or st.status
    if dead:
        last_t = as_number(st.series.last("t")) if st.series.n else None
        now = last_t if last_t is not None else st.updated or now
    style = "bold red" if dead or halted else STATUS_STYLE.get(st.status, "bold")
    step = st.step
    attention = st.ready.attention.split(" ", 1)[0] if st.ready and st.ready.attention else ""
    parts = [
        f"[bold]{escape(st.name)}[/]",
        f"{escape(st.backend)}/{escape(st.device)}"
        + (f" ×{st.world_size}" if st.world_size > 1 else "")
        + (f" attn {escape(attention)}" if attention else "")
        + (f" fp8 {len(st.ready.fp8_gemms)} MLP GEMMs" if st.ready and st.ready.fp8_gemms
           else ""),
        f"[{style}]{escape(status)}[/]",
        f"step [bold]{fmt_int(step)}[/]/{fmt_int(st.max_steps)}",
        f"tokens {fmt_num(st.tokens)}",
        *([] if halted else [f"{fmt_num(st.smooth_tok_s())} tok/s" + mfu_text(st)]),
        f"elapsed {fmt_duration(st.elapsed(now))}",
        *([] if halted else [f"ETA {fmt_duration(None if dead else st.eta())}"]),
    ]
    return Text.from_markup(" · ".join(parts))


def mfu_text(st: RunState) -> str:
    """` · MFU 41%` when the GPU's peak is known, else nothing."""
    mfu = st.mfu()
    return f" · MFU {fmt_num(100 * mfu, 2)}%" if mfu is not None else ""


def training(st: RunState) -> Text:
    """Loss, validation loss, clip ratio, lr, skipped steps, last checkpoint."""
    s = st.series
    ema = s.ema()
    ev = st.val_loss
    lines = [
        f"loss      {fmt_num(s.last('loss'), 4)}  (EMA {fmt_num(ema[-1] if len(ema) else None, 4)})",
        *([f"val loss  {fmt_num(ev.val_loss, 4)}  (step {fmt_int(ev.step)})"] if ev else []),
        f"grad norm {fmt_num(s.last('grad_norm'))}  (clip at {fmt_num(st.max_grad_norm)})",
        f"clip      {fmt_num(s.last('clip_scale'))} now · "
        f"{fmt_num(100 * s.clip_share(100), 3)}% of last {min(100, s.n)}",
        f"lr        {fmt_num(s.last('lr'))}",
        f"step time {fmt_num(s.last('step_ms'))} ms",
    ]
    text = Text.from_markup("\n".join(escape(x) for x in lines))
    skipped = s.skipped_count()
    text.append("\nskipped   ")
    text.append(f"{skipped} non-finite step(s)" if skipped else "0",
                style="bold red" if skipped else "")
    lc = st.last_checkpoint
    if lc:
        text.append(f"\nckpt      step {fmt_int(lc.step)} {lc.reason} {Path(lc.path).name}")
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
        out.append((f"rank {r:<3} {devices.get(r, '?'):<8} {fmt_num(tok_s)} tok/s"
                    f"  {fmt_num(t)} ms{note}", bool(note)))
    return out


def bandit(st: RunState, bar_width: int = 10, src_loss: dict[str, float] | None = None) -> Text:
    """Phase, mixture weights and per-source loss (`src_loss`: the values to show, if not the
    latest ones)."""
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
    name_w = min(max((len(n) for n in weights), default=0), 18)
    ev = st.val_loss
    if ev:
        bar_width = max(3, bar_width - 5)  # room for the validation column
    if weights:
        text.append(f"\n{'':<{name_w}} {'weight':<{bar_width + 5}} {'train':>6}"
                    + (f" {'val':>6}" if ev else ""), style="dim")
    for name, w in weights.items():
        loss = src_loss.get(name)
        text.append(f"\n{name[:name_w]:<{name_w}} ")
        text.append(bar(w, bar_width), style="cyan")
        text.append(f" {fmt_num(w, 2):>4} {fmt_num(loss, 4):>6}")
        if ev:
            text.append(f" {fmt_num(ev.src_val_loss.get(name), 4):>6}", style="yellow")
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
        text.append(f"\ngpu{g.index} {name} {fmt_num(g.util, 3)}% · {fmt_num(g.temp_c, 3)}°C · "
                    f"{fmt_num(g.power_w, 3)} W · {fmt_int(g.sm_clock_mhz).replace(',', '')} MHz")
        text.append(f"\n  mem {fmt_bytes(g.mem_used)} / {fmt_bytes(g.mem_total)}"
                    + (f" (plan {fmt_bytes(total)})" if total else ""))
    text.append(f"\ncpu {fmt_num(sysrec.cpu_pct, 3)}% of a core · rss {fmt_bytes(sysrec.rss_bytes)}")
    mfu = st.mfu()
    if mfu is not None:
        text.append(f"\nMFU {fmt_num(100 * mfu, 3)}% of {st.gpu_name} bf16 peak")
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
    else:
        detail = " ".join(f"{k}={v}" for k, v in e.details().items()
                          if not isinstance(v, (dict, list)))
    return f"{clock(e.t)} {e.kind} {detail}"


def events(st: RunState, n: int) -> Text:
    evs = list(st.events)[-n:]
    if not evs:
        return Text("no events yet", style="dim")
    text = Text(no_wrap=True, overflow="ellipsis")
    for i, e in enumerate(evs):
        text.append(("\n" if i else "") + event_line(e),
                    style="bold red" if isinstance(e, rec.AlertEvent) else "")
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
