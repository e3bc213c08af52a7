"""`andrea-tui runs [DIR]`: every run under a directory in one table, sorted and filtered.

enter opens the run's dashboard (the app exits with the choice; the command loop in cli.py runs
the dashboard, then comes back here), c its checkpoints, m marks runs and v overlays the marked
ones (compare_screen), e exports the current run's CSV and PNG into its directory. The table is
read by runscan.RunScanner in a thread worker, first the bounded parts, then whole files; it
refreshes every REFRESH_S seconds.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from rich.text import Text
from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Input, Static

from andrea_tui.runscan import DEAD, LIVE, RunScanner, RunSummary
from andrea_tui.textfmt import fmt_int, fmt_num

REFRESH_S = 2.0
NOTE_CHARS = 48


def _when(t: float | None) -> str:
    if t is None or not math.isfinite(t):
        return "–"
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(t))


def _num_key(x: float | int | None) -> float:
    """Sort key for a number: unknowns last whatever the direction is handled by the caller."""
    if x is None or not math.isfinite(float(x)):
        return math.inf
    return float(x)


STATUS_STYLE = {LIVE: "bold green", DEAD: "bold red", "failed": "red", "stopped": "yellow",
                "finished": "blue"}


@dataclass(frozen=True)
class Column:
    title: str
    cell: Callable[[RunSummary, Path], Any]
    key: Callable[[RunSummary], Any]
    numeric: bool = False


def _rel(s: RunSummary, root: Path) -> str:
    try:
        rel = s.path.relative_to(root)
    except ValueError:
        return str(s.path)
    return str(rel) if str(rel) != "." else s.path.name


def _steps(s: RunSummary) -> str:
    return f"{fmt_int(s.step)}/{fmt_int(s.max_steps)}" if s.max_steps else fmt_int(s.step)


COLUMNS: tuple[Column, ...] = (
    Column("experiment", lambda s, r: s.name, lambda s: s.name.lower()),
    Column("run", _rel, lambda s: str(s.path)),
    Column("status", lambda s, r: Text(s.status + (f" ({s.note.split(';')[0]})" if s.live and
                                                   s.note else ""),
                                       style=STATUS_STYLE.get(s.status, "")),
           lambda s: s.status),
    Column("step", lambda s, r: _steps(s), lambda s: _num_key(s.step), True),
    Column("loss", lambda s, r: fmt_num(s.last_loss, 4), lambda s: _num_key(s.last_loss), True),
    Column("best", lambda s, r: fmt_num(s.best_loss, 4), lambda s: _num_key(s.best_loss), True),
    Column("val loss", lambda s, r: fmt_num(s.val_loss, 4), lambda s: _num_key(s.val_loss),
           True),
    Column("tok/s", lambda s, r: fmt_num(s.tok_s), lambda s: _num_key(s.tok_s), True),
    Column("started", lambda s, r: _when(s.started), lambda s: _num_key(s.started), True),
    Column("backend", lambda s, r: s.backend or "–", lambda s: s.backend),
    Column("note", lambda s, r: (s.note if s.live or len(s.note) <= NOTE_CHARS
                                 else s.note[: NOTE_CHARS - 1] + "…"), lambda s: s.note),
)


@dataclass
class BrowserState:
    """What the browser keeps while a dashboard it opened is shown (the app is made anew)."""

    filter: str = ""
    sort: int = 8  # "started"
    reverse: bool = True  # newest first
    marked: list[Path] = field(default_factory=list)
    cursor: Path | None = None
    message: str | None = None  # told once when the browser comes back


def matches(s: RunSummary, root: Path, text: str) -> bool:
    """Every word of `text` is in the run's experiment, directory, status, backend or note."""
    hay = " ".join((s.name, _rel(s, root), s.status, s.backend, s.note)).lower()
    return all(w in hay for w in text.lower().split())


def ordered(rows: list[RunSummary], column: Column, reverse: bool) -> list[RunSummary]:
    """Sorted by `column`; for a number, the unknowns go last in either direction."""
    if column.numeric:
        known = [s for s in rows if column.key(s) != math.inf]
        unknown = [s for s in rows if column.key(s) == math.inf]
        return sorted(known, key=column.key, reverse=reverse) + unknown
    return sorted(rows, key=column.key, reverse=reverse)


class RunsScreen(Screen[None]):
    DEFAULT_CSS = """
    RunsScreen #runs-filter { height: 3; }
    RunsScreen #runs-table { height: 1fr; }
    RunsScreen #runs-header, RunsScreen #runs-detail { height: auto; padding: 0 1; }
    """
    BINDINGS: ClassVar[list[Binding]] = [
        Binding("c", "checkpoints", "checkpoints"),
        Binding("m,space", "mark", "mark"),
        Binding("v", "compare", "compare marked"),
        Binding("o", "sort", "sort"),
        Binding("O", "reverse", "reverse", show=False),
        Binding("e", "export", "export"),
        Binding("slash", "filter", "filter"),
        Binding("r", "refresh", "refresh", show=False),
        Binding("escape", "leave_filter", "table", show=False),
        Binding("q", "app.quit", "quit"),
    ]

    def __init__(self, root: Path, state: BrowserState, scanner: RunScanner) -> None:
        super().__init__()
        self.root = Path(root)
        self.state = state
        self.scanner = scanner
        self.summaries: list[RunSummary] = []
        self.shown: list[RunSummary] = []
        self.loaded = False
        self._scanning = False

    def compose(self) -> ComposeResult:
        yield Static(f"runs under {self.root} · reading…", id="runs-header")
        yield Input(self.state.filter, placeholder="filter (/): words in experiment, run, "
                    "status, backend", id="runs-filter")
        yield DataTable(id="runs-table", cursor_type="row", zebra_stripes=True)
        yield Static("", id="runs-detail")
        yield Footer()

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        for c in COLUMNS:
            table.add_column(c.title, key=c.title)
        table.focus()
        if self.state.message:
            self.notify(self.state.message)
            self.state.message = None
        self._start_scan(first=True)
        self.set_interval(REFRESH_S, self._start_scan)

    # ------------------------------------------------------------ reading

    def _start_scan(self, first: bool = False) -> None:
        """A scan in a worker thread, unless one is running (the scanner is not shared)."""
        if not self._scanning:
            self._scanning = True
            self._scan(first)

    @work(thread=True, group="runs-scan", exit_on_error=False)
    def _scan(self, first: bool) -> None:
        try:
            if first:  # the bounded parts first: a table at once, the whole files after
                self.app.call_from_thread(self._show, self.scanner.scan(whole_files=False))
            self.app.call_from_thread(self._show, self.scanner.scan(whole_files=True))
        finally:
            self._scanning = False

    def _show(self, summaries: list[RunSummary]) -> None:
        if self.loaded and summaries == self.summaries:
            return  # nothing new: the table (and where it is scrolled to) stays
        self.summaries = summaries
        self.loaded = True
        self._render_table()

    def _render_table(self) -> None:
        table = self.query_one(DataTable)
        current = self.current()
        keep = current.path if current else self.state.cursor
        col = COLUMNS[self.state.sort]
        rows = [s for s in self.summaries if matches(s, self.root, self.state.filter)]
        self.shown = ordered(rows, col, self.state.reverse)
        table.clear()
        marked = set(self.state.marked)
        for s in self.shown:
            cells = [c.cell(s, self.root) for c in COLUMNS]
            if s.path in marked:
                cells[0] = Text("● " + s.name, style="bold")
            table.add_row(*cells, key=str(s.path))
        for i, s in enumerate(self.shown):
            if s.path == keep:
                table.move_cursor(row=i)
                break
        arrow = "↓" if self.state.reverse else "↑"
        n_live = sum(s.live for s in self.summaries)
        n_dead = sum(s.status == DEAD for s in self.summaries)
        filt = f" · filter {self.state.filter!r}: {len(self.shown)} shown" \
            if self.state.filter.strip() else ""
        self.query_one("#runs-header", Static).update(
            f"{len(self.summaries)} runs under {self.root} ({n_live} live, {n_dead} dead){filt}"
            f" · sorted by {col.title} {arrow} · marked {len(self.state.marked)}"
            " · enter: dashboard")
        self._show_detail()

    def current(self) -> RunSummary | None:
        table = self.query_one(DataTable)
        if not self.shown or table.cursor_row is None:
            return None
        return self.shown[min(table.cursor_row, len(self.shown) - 1)]

    def _show_detail(self) -> None:
        s = self.current()
        detail = self.query_one("#runs-detail", Static)
        if s is None:
            detail.update("no run here" if self.loaded else "")
            return
        self.state.cursor = s.path
        detail.update(Text(f"{s.path}" + (f"\n{s.note}" if s.note else ""), style="dim"))

    def on_data_table_row_highlighted(self, _event: DataTable.RowHighlighted) -> None:
        self._show_detail()

    def on_data_table_row_selected(self, _event: DataTable.RowSelected) -> None:
        self.action_open()

    def on_data_table_header_selected(self, event: DataTable.HeaderSelected) -> None:
        i = event.column_index
        if i == self.state.sort:
            self.state.reverse = not self.state.reverse
        else:
            self.state.sort, self.state.reverse = i, COLUMNS[i].numeric
        self._render_table()

    def on_input_changed(self, event: Input.Changed) -> None:
        self.state.filter = event.value
        if self.loaded:
            self._render_table()

    def on_input_submitted(self, _event: Input.Submitted) -> None:
        self.query_one(DataTable).focus()

    # ------------------------------------------------------------ keys

    def action_open(self) -> None:
        s = self.current()
        if s is not None:
            self.app.exit(s.path)

    def action_checkpoints(self) -> None:
        from andrea_tui.ckpt_screens import CheckpointListScreen

        s = self.current()
        if s is not None:
            self.app.push_screen(CheckpointListScreen(s.path))

    def action_mark(self) -> None:
        s = self.current()
        if s is None:
            return
        if s.path in self.state.marked:
            self.state.marked.remove(s.path)
        else:
            self.state.marked.append(s.path)
        self._render_table()

    def action_compare(self) -> None:
        from andrea_tui.compare_screen import RunCompareScreen

        marked = [p for p in self.state.marked if p.is_dir()]
        if len(marked) < 2:
            self.notify("mark two or more runs (m), then v to compare them", severity="warning")
            return
        self.app.push_screen(RunCompareScreen(marked))

    def action_sort(self) -> None:
        self.state.sort = (self.state.sort + 1) % len(COLUMNS)
        self.state.reverse = COLUMNS[self.state.sort].numeric
        self._render_table()

    def action_reverse(self) -> None:
        self.state.reverse = not self.state.reverse
        self._render_table()

    def action_export(self) -> None:
        from andrea_tui.export import export_in_background

        s = self.current()
        if s is not None:
            export_in_background(self.app, s.path)

    def action_filter(self) -> None:
        self.query_one(Input).focus()

    def action_leave_filter(self) -> None:
        self.query_one(DataTable).focus()

    def action_refresh(self) -> None:
        self._start_scan()


class RunsApp(App[Path | None]):
    """The runs browser; exits with the run directory whose dashboard was asked for (None on
    quit)."""

    CSS_PATH = "andrea.tcss"
    TITLE = "ANDREA runs"

    def __init__(self, root: Path, state: BrowserState | None = None,
                 scanner: RunScanner | None = None) -> None:
        super().__init__()
        self.root = Path(root)
        self.browser_state = state or BrowserState()
        self.scanner = scanner or RunScanner(self.root)

    def on_mount(self) -> None:
        self.push_screen(RunsScreen(self.root, self.browser_state, self.scanner))
