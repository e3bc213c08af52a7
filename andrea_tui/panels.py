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
        now = last_t if last_t is not None else as_number(st.state.get("updated")) or now
    style = "bold red" if dead else STATUS_STYLE.get(st.status, "bold")
    step = st.step
    parts = [
        f"[bold]{escape(st.name)}[/]",
        f"{escape(st.backend)}/{escape(st.device)}",
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
        text.append(f"\nckpt      step {fmt_int(lc.get('step'))} {lc.get('reason', '')} "
                    f"{Path(str(lc.get('path', ''))).name}")
    if st.bad_lines:
        text.append(f"\n{st.bad_lines} corrupt line(s) skipped", style="yellow")
    text.no_wrap, text.overflow = True, "ellipsis"
    return text


def bandit(st: RunState, bar_width: int = 10, src_loss: dict[str, float] | None = None) -> Text:
    """Phase, mixture weights and per-source loss (`src_loss`: the values to show, if not the
    latest ones)."""
    src_loss = st.src_loss if src_loss is None else src_loss
    r = st.last_record
    phase, pstep, plen = r.get("phase"), r.get("phase_step"), r.get("phase_len")
    text = Text.from_markup(
        f"[bold]phase {fmt_int(phase)}[/] · step {fmt_int(pstep)}/{fmt_int(plen)}"
    )
    if st.phase_changes:
        pc = st.phase_changes[-1]
        recent = st.step is not None and st.step - pc.step < 3
        text.append(f" · began at step {pc.step}",
                    style="bold reverse magenta" if recent else "magenta")
    weights = r.get("weights") if isinstance(r.get("weights"), dict) else {}
    name_w = max((len(str(n)) for n in weights), default=0)
    for name, w in weights.items():
        wf = float(w) if isinstance(w, (int, float)) else math.nan
        loss = src_loss.get(str(name))
        text.append(f"\n{str(name)[:18]:<{min(name_w, 18)}} ")
        text.append(bar(wf, bar_width), style="cyan")
        text.append(f" {fmt_num(wf, 2):>4} {fmt_num(loss, 4):>6}")
    text.no_wrap, text.overflow = True, "ellipsis"
    return text


def memory(st: RunState) -> Text:
    plan = st.memory_plan
    if not plan:
        return Text("memory plan: not yet reported", style="dim")
    lines = [f"params {fmt_int(st.ready.get('n_params'))}"]
    for k in ("weights", "grads", "adam_m", "adam_v", "activations", "scratch", "total"):
        if k in plan:
            lines.append(f"{k:<12}{fmt_bytes(plan[k]):>10}")
    return Text("\n".join(lines))


def sample(st: RunState) -> Text:
    s = st.last_sample
    if not s:
        return Text("no sample yet", style="dim")
    text = Text(f"step {fmt_int(s.get('step'))} · ", style="bold")
    text.append(repr(s.get("prompt", "")), style="cyan")
    text.append(" → ")
    text.append(str(s.get("text", "")).replace("\n", "⏎ "))
    return text


def event_line(e: dict[str, Any]) -> str:
    kind = e.get("event")
    rest = {k: v for k, v in e.items() if k not in ("t", "event")}
    if kind == "checkpoint":
        detail = (f"step {rest.get('step')} {rest.get('reason')} "
                  f"{Path(str(rest.get('path'))).name} "
                  f"({fmt_bytes(rest.get('bytes'))}, {fmt_num(rest.get('seconds'))} s)")
    elif kind == "ready":
        detail = f"{rest.get('backend')}/{rest.get('device')} params {fmt_int(rest.get('n_params'))}"
    elif kind == "start":
        detail = f"pid {rest.get('pid')} resumed={rest.get('resumed')}"
    elif kind in ("prep", "error"):
        detail = str(rest.get("message", ""))
    else:
        detail = " ".join(f"{k}={v}" for k, v in rest.items()
                          if not isinstance(v, (dict, list)))
    return f"{clock(e.get('t'))} {kind} {detail}"


def events(st: RunState, n: int) -> Text:
    lines = [event_line(e) for e in list(st.events)[-n:]]
    return Text("\n".join(lines) if lines else "no events yet", style="" if lines else "dim",
                no_wrap=True, overflow="ellipsis")
