"""The dashboard's text panels as Rich Text, built from a RunState (no widgets here).

Kept apart from the widgets so tests can check the values on a panel without a screen.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

from rich.markup import escape
from rich.text import Text

from andrea_tui.runstate import RunState
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


def header(st: RunState, now: float, note: str = "", dead: bool = False) -> Text:
    """`dead`: no engine behind a run its files call live: elapsed stops at the last record
    and there is no ETA."""
    status = note or st.status
    if dead:
        last_t = as_number(st.series.last("t")) if st.series.n else None
        now = last_t if last_t is not None else st.updated or now
    style = "bold red" if dead else STATUS_STYLE.get(st.status, "bold")
    step = st.step
    attention = st.ready.attention.split(" ", 1)[0] if st.ready and st.ready.attention else ""
    parts = [
        f"[bold]{escape(st.name)}[/]",
        f"{escape(st.backend)}/{escape(st.device)}"
        + (f" ×{st.world_size}" if st.world_size > 1 else "")
        + (f" attn {escape(attention)}" if attention else ""),
        f"[{style}]{escape(status)}[/]",
        f"step [bold]{fmt_int(step)}[/]/{fmt_int(st.max_steps)}",
        f"tokens {fmt_num(st.tokens)}",
        f"{fmt_num(st.tok_s)} tok/s",
        f"elapsed {fmt_duration(st.elapsed(now))}",
        f"ETA {fmt_duration(None if dead else st.eta())}",
    ]
    return Text.from_markup(" · ".join(parts))


def training(st: RunState) -> Text:
    """Loss, clip ratio, lr, skipped steps, last checkpoint."""
    s = st.series
    ema = s.ema()
    lines = [
        f"loss      {fmt_num(s.last('loss'), 4)}  (EMA {fmt_num(ema[-1] if len(ema) else None, 4)})",
        f"grad norm {fmt_num(s.last('grad_norm'))}  max {fmt_num(st.max_grad_norm)}",
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
    if st.bad_lines or st.unreadable:
        text.append(f"\n{st.bad_lines + st.unreadable} corrupt line(s) skipped", style="yellow")
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
    name_w = max((len(n) for n in weights), default=0)
    for name, w in weights.items():
        loss = src_loss.get(name)
        text.append(f"\n{name[:18]:<{min(name_w, 18)}} ")
        text.append(bar(w, bar_width), style="cyan")
        text.append(f" {fmt_num(w, 2):>4} {fmt_num(loss, 4):>6}")
    text.no_wrap, text.overflow = True, "ellipsis"
    return text


def memory(st: RunState) -> Text:
    plan = st.memory_plan
    if not plan:
        return Text("memory plan: not yet reported", style="dim")
    lines = [f"params {fmt_int(st.ready.n_params if st.ready else None)}"]
    for k in ("weights", "grads", "adam_m", "adam_v", "activations", "scratch", "total"):
        if k in plan:
            lines.append(f"{k:<12}{fmt_bytes(plan[k]):>10}")
    return Text("\n".join(lines))


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
    else:
        detail = " ".join(f"{k}={v}" for k, v in e.details().items()
                          if not isinstance(v, (dict, list)))
    return f"{clock(e.t)} {e.kind} {detail}"


def events(st: RunState, n: int) -> Text:
    lines = [event_line(e) for e in list(st.events)[-n:]]
    return Text("\n".join(lines) if lines else "no events yet", style="" if lines else "dim",
                no_wrap=True, overflow="ellipsis")
