"""Checkpoint browser: list (verified), detail (header, tensor stats, state), compare two.

Verifying, loading and statistics read whole model files, so they run in thread workers; the
engine's checkpoint module (numpy) is imported there, never at app start. `g` generates text from
a checkpoint (generate_screen: andrea-sample in a child process).
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, ClassVar

from rich.cells import cell_len
from rich.text import Text
from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Static

from andrea_tui import settings as user_settings
from andrea_tui.generate_screen import GenerateScreen
from andrea_tui.textfmt import fmt_bytes, fmt_int, fmt_num

ROW_LIMIT = 1000  # rows shown for the listing; a valid checkpoint beyond them gets one too
FLUSH_S = 0.2  # how often verified rows are filled in


def _step_of(path: Path) -> int:
    """The step in a `step_XXXXXXXX[-k]` name."""
    return int(path.name[5:13])


def _cells(e: Any) -> tuple[Any, ...]:
    """One checkpoint's row (an engine.run.checkpoint.CheckpointEntry)."""
    valid = Text("valid", style="green") if e.valid else Text("INVALID", style="bold red")
    # The reason names the full path; the row already says which checkpoint it is.
    why = e.path.name if e.valid else (e.invalid_reason or "").replace(
        str(e.path.parent) + "/", "")
    return (fmt_int(e.step), e.reason or "?", _when(e.wall_time), fmt_bytes(e.bytes), valid, why)


def _when(t: float | None) -> str:
    if t is None or not math.isfinite(t):
        return "–"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def is_single_checkpoint(path: Path) -> bool:
    from engine.run.checkpoint import MODEL_FILE

    return (Path(path) / MODEL_FILE).exists()


def relative_changes(a: Any, b: Any) -> list[dict[str, Any]]:
    """Per tensor of `a`'s table: ||w_b - w_a|| / ||w_a|| (both checkpoints loaded)."""
    import numpy as np

    from engine.run.checkpoint import normalize_tensor_table

    tb = {t["name"]: t for t in normalize_tensor_table(b.tensor_table)}
    out = []
    for t in normalize_tensor_table(a.tensor_table):
        size = int(np.prod(t["shape"], dtype=np.int64))
        other = tb.get(t["name"])
        if other is None or list(other["shape"]) != list(t["shape"]):
            out.append({"name": t["name"], "shape": t["shape"], "rel": None,
                        "note": "missing or reshaped in the second checkpoint"})
            continue
        wa = a.params[t["offset"]: t["offset"] + size].astype(np.float64)
        wb = b.params[other["offset"]: other["offset"] + size].astype(np.float64)
        na = float(np.linalg.norm(wa))
        diff = float(np.linalg.norm(wb - wa))
        rel = diff / na if na > 0 else (0.0 if diff == 0 else math.inf)
        out.append({"name": t["name"], "shape": t["shape"], "rel": rel, "note": ""})
    return out


def _close(screen: Screen) -> None:
    """Back to the screen below; in `andrea-tui ckpt` (nothing of ours below) leave the app."""
    app = screen.app
    if isinstance(app, CheckpointApp) and len(app.screen_stack) <= 2:
        app.exit()
    else:
        app.pop_screen()


class CheckpointListScreen(Screen[None]):
    """All checkpoints of a run, newest first, each verified (sha256 included).

    The rows come from the directory listing alone (names and directory tests: nothing is
    opened), so they show at once however many `step_*` entries there are; a worker then
    verifies them newest first and fills each row in. At most ROW_LIMIT rows are shown for
    the listing; an entry beyond it gets a row only when it verifies (a valid checkpoint is
    never hidden), and the header counts the invalid ones left out."""

    BINDINGS: ClassVar[list[Binding]] = [
        # q closes here: the dashboard's q (stop the engine) must not fire from a pushed screen.
        Binding("escape,c,q", "close", "back"),
        Binding("enter", "open", "details"),
        Binding("m", "mark", "mark/compare"),
        Binding("g", "generate", "generate"),
        Binding("r", "reload", "reload"),
    ]

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = Path(path)
        self.rows: list[Path] = []  # the checkpoint directory of each row, in row order
        self.entries: list[Any] = []  # the rows verified so far (a prefix of `rows`)
        self.marked: list[Path] = []
        self._gen = 0  # which listing the worker's results belong to (r starts another)
        self._found = 0
        self._bad = 0
        self._hidden = 0  # invalid entries beyond ROW_LIMIT, counted, not shown
        self._cols: list[Any] = []

    def compose(self) -> ComposeResult:
        yield Static(f"checkpoints of {self.path} · verifying…", id="ckpt-header")
        yield DataTable(id="ckpt-list", cursor_type="row", zebra_stripes=True)
        yield Footer()

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        self._cols = table.add_columns("step", "reason", "written", "size", "valid",
                                       "path / why invalid")
        self._start_load()

    def action_reload(self) -> None:
        self.query_one("#ckpt-header", Static).update(f"checkpoints of {self.path} · verifying…")
        self._start_load()

    def _start_load(self) -> None:
        self._gen += 1
        self._load(self._gen)

    @work(thread=True, exclusive=True, group="ckpt-list", exit_on_error=False)
    def _load(self, gen: int) -> None:
        from textual.worker import get_current_worker

        from engine.run.checkpoint_store import checkpoint_dirs, checkpoint_entry

        worker = get_current_worker()
        dirs = checkpoint_dirs(self.path)
        self.app.call_from_thread(self._show_names, gen, dirs)
        batch: list[Any] = []
        flushed = time.monotonic()
        for p in dirs:
            if worker.is_cancelled:
                return
            batch.append(checkpoint_entry(p))
            if time.monotonic() - flushed >= FLUSH_S:
                self.app.call_from_thread(self._show_verified, gen, batch, False)
                batch, flushed = [], time.monotonic()
        self.app.call_from_thread(self._show_verified, gen, batch, True)

    def _show_names(self, gen: int, dirs: list[Path]) -> None:
        if gen != self._gen:
            return
        table = self.query_one(DataTable)
        table.clear()
        self.rows = list(dirs[:ROW_LIMIT])
        self.entries = []
        self._found, self._bad, self._hidden = len(dirs), 0, 0
        # Placeholders no wider than what replaces them: a column keeps its widest content.
        for p in self.rows:
            table.add_row(fmt_int(_step_of(p)), "", "", "", "…", p.name, key=str(p))
        self._header(done=not dirs)

    def _show_verified(self, gen: int, batch: list[Any], done: bool) -> None:
        if gen != self._gen:
            return
        table = self.query_one(DataTable)
        widest: dict[Any, tuple[int, str, Any]] = {}  # column -> (width, row, value)
        for e in batch:
            self._bad += not e.valid
            cells = _cells(e)
            if len(self.entries) < len(self.rows):
                for col, value in zip(self._cols, cells, strict=True):
                    table.update_cell(str(e.path), col, value)
                    width = value.cell_len if isinstance(value, Text) else cell_len(value)
                    if width > widest.get(col, (-1,))[0]:
                        widest[col] = (width, str(e.path), value)
            elif e.valid:  # beyond the listed rows: shown because it verifies
                table.add_row(*cells, key=str(e.path))
                self.rows.append(e.path)
            else:
                self._hidden += 1
                continue
            self.entries.append(e)
        # A column grows to its widest cell, as when rows are added; measuring only the widest
        # new one keeps this linear (a narrower update makes DataTable measure the column).
        for col, (width, key, value) in widest.items():
            if width > table.columns[col].content_width:
                table.update_cell(key, col, value, update_width=True)
        self._header(done)

    def _header(self, done: bool) -> None:
        checked = len(self.entries) + self._hidden
        state = (f"{self._found:,} found, {self._bad:,} invalid" if done else
                 f"{self._found:,} found, verifying {checked:,} of {self._found:,}…")
        if self._hidden:
            state += (f" ({self._hidden:,} invalid beyond the first {ROW_LIMIT:,} not shown: "
                      f"andrea-ckpt verify {self.path} lists each)")
        self.query_one("#ckpt-header", Static).update(
            f"{state} · enter: details · m: mark two to compare · g: generate text"
            f"\ncheckpoints of {self.path}"
        )

    def _current(self) -> Any | None:
        """The cursor's checkpoint, verified; None (and a word) while it is being verified."""
        table = self.query_one(DataTable)
        row = table.cursor_row
        if not self.rows or row is None:
            return None
        if row >= len(self.entries):
            self.notify("still verifying this checkpoint", severity="warning", markup=False)
            return None
        return self.entries[row]

    def action_open(self) -> None:
        e = self._current()
        if e is None:
            return
        if not e.valid:
            self.notify(f"cannot open: {e.invalid_reason}", severity="error", markup=False)
            return
        self.app.push_screen(CheckpointDetailScreen(e.path))

    def on_data_table_row_selected(self, _event: DataTable.RowSelected) -> None:
        self.action_open()

    def action_generate(self) -> None:
        e = self._current()
        if e is None and self.rows:
            return  # still being verified: said
        if e is None or not e.valid:
            self.notify("generate from a valid checkpoint", severity="warning", markup=False)
            return
        self.app.push_screen(GenerateScreen(e.path))

    def action_mark(self) -> None:
        e = self._current()
        if e is None and self.rows:
            return  # still being verified: said
        if e is None or not e.valid:
            self.notify("mark a valid checkpoint", severity="warning", markup=False)
            return
        if e.path in self.marked:
            self.marked.remove(e.path)
        else:
            self.marked.append(e.path)
        if len(self.marked) == 2:
            older, newer = sorted(self.marked, key=lambda p: p.name)
            self.marked = []
            self.app.push_screen(CompareScreen(older, newer))
        else:
            self.notify(f"marked {e.path.name}; mark another to compare", markup=False)

    def action_close(self) -> None:
        _close(self)


class CheckpointDetailScreen(Screen[None]):
    """One checkpoint: header, per-tensor stats of weights/m/v, the state summary."""

    BINDINGS: ClassVar[list[Binding]] = [Binding("escape,q", "close", "back"),
                                         Binding("g", "generate", "generate")]

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = Path(path)
        self.stats: list[dict[str, Any]] = []

    def compose(self) -> ComposeResult:
        yield Static(f"{self.path} · loading and verifying…", id="ckpt-header")
        yield DataTable(id="ckpt-tensors", zebra_stripes=True)
        yield Static("", id="ckpt-state")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one(DataTable).add_columns(
            "tensor", "shape", "w mean", "w std", "w rms", "w max|x|", "m rms", "v rms")
        self._load()

    @work(thread=True, exclusive=True, group="ckpt-detail", exit_on_error=False)
    def _load(self) -> None:
        from engine.errors import UserError
        from engine.run.checkpoint import load_checkpoint, tensor_stats

        try:
            ck = load_checkpoint(self.path)
            stats = tensor_stats(ck)
        except UserError as e:
            self.app.call_from_thread(self._fail, str(e))
            return
        self.app.call_from_thread(self._show, ck.state, stats)

    def _fail(self, why: str) -> None:
        self.query_one("#ckpt-header", Static).update(Text(f"INVALID: {why}", style="bold red"))

    def _show(self, state: dict[str, Any], stats: list[dict[str, Any]]) -> None:
        self.stats = stats
        self.query_one("#ckpt-header", Static).update(checkpoint_header(self.path, state))
        table = self.query_one(DataTable)
        for t in stats:
            w, m, v = t["weights"], t["m"], t["v"]
            table.add_row(t["name"], "×".join(str(d) for d in t["shape"]),
                          fmt_num(w["mean"]), fmt_num(w["std"]), fmt_num(w["rms"]),
                          fmt_num(w["max_abs"]), fmt_num(m["rms"]), fmt_num(v["rms"]))
        self.query_one("#ckpt-state", Static).update(state_summary(state))

    def action_generate(self) -> None:
        self.app.push_screen(GenerateScreen(self.path))

    def action_close(self) -> None:
        _close(self)


def checkpoint_header(path: Path, state: dict[str, Any]) -> str:
    mc = state.get("model_ckpt") if isinstance(state.get("model_ckpt"), dict) else {}
    return (f"[b]{path}[/b]\nstep {fmt_int(state.get('step'))} · reason {state.get('reason')} · "
            f"written {_when(state.get('wall_time'))} · params {fmt_int(state.get('n_params'))} · "
            f"model.ckpt {fmt_bytes(mc.get('size'))} sha256 {str(mc.get('sha256', ''))[:12]}… "
            "· verified")


def _brief(v: Any, width: int = 90) -> str:
    if isinstance(v, dict):
        s = ", ".join(f"{k}={_brief(x, 30)}" for k, x in v.items()
                      if not isinstance(x, (list, dict)) or len(str(x)) < 60)
    elif isinstance(v, float):
        s = fmt_num(v, 4)
    else:
        s = str(v)
    return s if len(s) <= width else s[: width - 1] + "…"


def state_summary(state: dict[str, Any]) -> str:
    """The resume state besides the tensors: bandit, data, schedule and anything else."""
    skip = {"format_version", "step", "n_params", "model_ckpt", "tensor_table", "reason",
            "wall_time"}
    lines = []
    for key in ("bandit", "data", "schedule"):
        if key in state:
            lines.append(f"[b]{key}[/b]: {_brief(state[key])}")
    for key, v in state.items():
        if key not in skip and key not in ("bandit", "data", "schedule"):
            lines.append(f"[b]{key}[/b]: {_brief(v)}")
    return "\n".join(lines) or "(no state besides the tensors)"


class CompareScreen(Screen[None]):
    """Per-tensor relative change of the weights between two checkpoints."""

    BINDINGS: ClassVar[list[Binding]] = [Binding("escape,q", "app.pop_screen", "back")]

    def __init__(self, a: Path, b: Path) -> None:
        super().__init__()
        self.a, self.b = Path(a), Path(b)
        self.rows: list[dict[str, Any]] = []

    def compose(self) -> ComposeResult:
        yield Static(f"comparing {self.a.name} → {self.b.name} · loading…", id="ckpt-header")
        yield DataTable(id="ckpt-compare", zebra_stripes=True)
        yield Footer()

    def on_mount(self) -> None:
        self.query_one(DataTable).add_columns("tensor", "shape", "‖Δw‖/‖w‖", "")
        self._load()

    @work(thread=True, exclusive=True, group="ckpt-compare", exit_on_error=False)
    def _load(self) -> None:
        from engine.errors import UserError
        from engine.run.checkpoint import load_checkpoint

        try:
            a, b = load_checkpoint(self.a), load_checkpoint(self.b)
        except UserError as e:
            self.app.call_from_thread(self._header, f"[b red]cannot compare: {e}[/]")
            return
        rows = relative_changes(a, b)
        self.app.call_from_thread(self._show, a.step, b.step, rows)

    def _header(self, text: str) -> None:
        self.query_one("#ckpt-header", Static).update(text)

    def _show(self, step_a: int, step_b: int, rows: list[dict[str, Any]]) -> None:
        self.rows = rows
        self._header(f"[b]{self.a}[/b] (step {step_a}) → [b]{self.b}[/b] (step {step_b}): "
                     "relative change of each tensor's weights")
        table = self.query_one(DataTable)
        top = max((r["rel"] for r in rows if r["rel"] is not None), default=0.0) or 1.0
        for r in rows:
            shape = "×".join(str(d) for d in r["shape"])
            if r["rel"] is None:
                table.add_row(r["name"], shape, "–", r["note"])
            else:
                n = round(20 * r["rel"] / top) if math.isfinite(r["rel"]) else 20
                table.add_row(r["name"], shape, fmt_num(r["rel"], 4), "█" * n)


class CheckpointApp(App[None]):
    """`andrea-tui ckpt PATH`: the browser alone, on a run dir, checkpoints dir or checkpoint."""

    CSS_PATH = "andrea.tcss"
    TITLE = "ANDREA checkpoints"
    BINDINGS: ClassVar[list[Binding]] = [Binding("q", "quit", "quit")]

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = Path(path)

    def on_mount(self) -> None:
        user_settings.keep_theme(self)
        if is_single_checkpoint(self.path):
            self.push_screen(CheckpointDetailScreen(self.path))
        else:
            self.push_screen(CheckpointListScreen(self.path))
