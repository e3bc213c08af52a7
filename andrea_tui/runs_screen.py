"""`andrea-tui runs [DIR]`: every run under a directory in one table, sorted and filtered.

enter opens the run's dashboard (the app exits with the choice; the command loop in cli.py runs
the dashboard, then comes back here, also on escape), c its checkpoints, m marks runs and v
overlays the marked ones (compare_screen), e exports the current run's CSV and PNG into its
directory, n and t edit the user's note and tags of a run (andrea_tui.notes; `#tag` in the
filter keeps the runs with that tag). The table shows each run's health as the engine judged it,
its best loss (validation where the run evaluates, else smoothed) and the settings runs differ
in most (lr, tokens per step, parameters, precision). It is read by runscan.RunScanner in a
thread worker, first the bounded parts, then whole files; it refreshes every REFRESH_S seconds,
changing cells in place while the rows stay the same (the table keeps where it is scrolled).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

from rich.text import Text
from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen, Screen
from textual.widgets import DataTable, Footer, Input, Static

from andrea_tui import settings as user_settings
from andrea_tui.notes import NotesError, RunNotes, parse_note, parse_tags, write_notes
from andrea_tui.runscan import DEAD, LIVE, RunScanner, RunSummary
from andrea_tui.textfmt import fmt_int, fmt_loss, fmt_lr, fmt_si

REFRESH_S = 2.0
NOTE_CHARS = 48
PALETTE_MIN_WIDTH = 96  # narrower, the footer leaves out `^p palette` (ctrl+p still opens it)


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
# The engine's judgement of a run (engine.records.Health), in colour.
HEALTH_STYLE = {"healthy": "green", "warning": "bold yellow", "diverging": "bold red",
                "stalled": "bold magenta", "failed": "red"}
BEST = "best"  # the best-loss column's key; its header says which loss (best_header)
TAGS_CHARS = 24


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


def _health(s: RunSummary) -> Text:
    return Text(s.health or "–", style=HEALTH_STYLE.get(s.health, "dim"))


def best_header(rows: list[RunSummary]) -> str:
    """The best-loss column's header for these rows: which loss it is (`best val`: the lowest
    validation loss; `best ema`: the lowest smoothed training loss, for runs that never
    evaluated); with both kinds among the rows, the smoothed ones are starred."""
    kinds = {s.best[1] for s in rows} - {""}
    if kinds == {"ema"}:
        return "best ema"
    if kinds == {"val", "ema"}:
        return "best val (ema*)"
    return "best val"


def _best_cell(s: RunSummary, starred: bool) -> str:
    """The best loss; `starred` (both kinds in the column): a smoothed one gets a star."""
    value, kind = s.best
    return fmt_loss(value) + (("*" if kind == "ema" else " ") if starred else "")


def _tags(s: RunSummary) -> str:
    text = " ".join(f"#{t}" for t in s.notes.tags)
    return text if len(text) <= TAGS_CHARS else text[: TAGS_CHARS - 1] + "…"


def _params(s: RunSummary) -> str:
    return fmt_si(s.n_params) if s.n_params else "–".rjust(5)


COLUMNS: tuple[Column, ...] = (
    Column("experiment", lambda s, r: s.name, lambda s: s.name.lower()),
    Column("run", _rel, lambda s: str(s.path)),
    Column("status", lambda s, r: Text(s.status + (f" ({s.note.split(';')[0]})" if s.live and
                                                   s.note else ""),
                                       style=STATUS_STYLE.get(s.status, "")),
           lambda s: s.status),
    Column("health", lambda s, r: _health(s), lambda s: s.health),
    Column("step", lambda s, r: _steps(s), lambda s: _num_key(s.step), True),
    Column("loss", lambda s, r: fmt_loss(s.last_loss), lambda s: _num_key(s.last_loss), True),
    Column(BEST, lambda s, r: _best_cell(s, False), lambda s: _num_key(s.best[0]), True),
    Column("val loss", lambda s, r: fmt_loss(s.val_loss), lambda s: _num_key(s.val_loss),
           True),
    Column("lr", lambda s, r: fmt_lr(s.lr), lambda s: _num_key(s.lr), True),
    Column("tok/step", lambda s, r: fmt_si(s.tokens_per_step),
           lambda s: _num_key(s.tokens_per_step), True),
    Column("params", lambda s, r: _params(s), lambda s: _num_key(s.n_params), True),
    Column("prec", lambda s, r: s.precision or "–", lambda s: s.precision),
    Column("tok/s", lambda s, r: fmt_si(s.tok_s), lambda s: _num_key(s.tok_s), True),
    Column("started", lambda s, r: _when(s.started), lambda s: _num_key(s.started), True),
    Column("backend", lambda s, r: s.backend or "–", lambda s: s.backend),
    Column("tags", lambda s, r: _tags(s), lambda s: " ".join(s.notes.tags).lower()),
    Column("note", lambda s, r: (s.note if s.live or len(s.note) <= NOTE_CHARS
                                 else s.note[: NOTE_CHARS - 1] + "…"), lambda s: s.note),
)
STARTED = [c.title for c in COLUMNS].index("started")


@dataclass
class BrowserState:
    """What the browser keeps while a dashboard it opened is shown (the app is made anew)."""

    filter: str = ""
    sort: int = STARTED
    reverse: bool = True  # newest first
    marked: list[Path] = field(default_factory=list)
    cursor: Path | None = None
    message: str | None = None  # told once when the browser comes back


def matches(s: RunSummary, root: Path, text: str) -> bool:
    """Every word of `text` is in the run's experiment, directory, status, health, backend,
    note or the user's note and tags; a word `#tag` is one of the run's tags."""
    tags = {t.lower() for t in s.notes.tags}
    hay = " ".join((s.name, _rel(s, root), s.status, s.health, s.backend, s.note,
                    s.notes.note, *(f"#{t}" for t in s.notes.tags))).lower()
    for w in text.lower().split():
        if w.startswith("#") and len(w) > 1:
            if w[1:] not in tags:
                return False
        elif w not in hay:
            return False
    return True


def settings_line(s: RunSummary) -> str:
    """What the run trains with, in words: lr, the batch and its tokens, parameters,
    precision."""
    parts = []
    if math.isfinite(s.lr):
        parts.append(f"lr {fmt_lr(s.lr)}")
    if s.batch_size:
        batch = f"batch {s.batch_size} × accum {s.grad_accum or 1} × seq {fmt_int(s.seq_len)}"
        if s.world_size > 1:
            batch += f" × {s.world_size} ranks"
        if s.tokens_per_step:
            batch += f" = {fmt_int(s.tokens_per_step)} tokens/step"
        parts.append(batch)
    if s.n_params:
        parts.append(f"{fmt_int(s.n_params)} parameters")
    if s.precision:
        parts.append(s.precision)
    return " · ".join(parts)


class EditScreen(ModalScreen[str | None]):
    """One line of text to edit (a run's note or tags): enter keeps it, escape leaves it."""

    DEFAULT_CSS = """
    EditScreen { align: center middle; }
    EditScreen #edit-box { width: 76; max-width: 100%; height: auto; border: thick $primary;
                           background: $surface; padding: 0 1; }
    EditScreen #edit-title, EditScreen #edit-hint { height: auto; }
    """
    BINDINGS: ClassVar[list[Binding]] = [Binding("escape", "cancel", "cancel")]

    def __init__(self, title: str, value: str, hint: str) -> None:
        super().__init__()
        self.title_text, self.value, self.hint = title, value, hint

    def compose(self) -> ComposeResult:
        with Vertical(id="edit-box"):
            yield Static(self.title_text, id="edit-title")
            yield Input(self.value, id="edit-input")
            yield Static(Text(self.hint, style="dim"), id="edit-hint")

    def on_mount(self) -> None:
        self.query_one(Input).focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.dismiss(event.value)

    def action_cancel(self) -> None:
        self.dismiss(None)


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
    # Short descriptions in a compact footer: every key shows at 80 columns.
    BINDINGS: ClassVar[list[Binding]] = [
        Binding("c", "checkpoints", "ckpts"),
        Binding("m,space", "mark", "mark"),
        Binding("v", "compare", "compare"),
        Binding("o", "sort", "sort"),
        Binding("O", "reverse", "reverse", show=False),
        Binding("e", "export", "export"),
        Binding("n", "edit_note", "note"),
        Binding("t", "edit_tags", "tags"),
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
                    "status, health, backend, notes; #tag for a tag", id="runs-filter")
        yield DataTable(id="runs-table", cursor_type="row", zebra_stripes=True)
        yield Static("", id="runs-detail")
        yield Footer(compact=True)

    def on_resize(self, event: Any) -> None:
        self._fit_footer(event.size.width)

    def _fit_footer(self, width: int) -> None:
        footer = self.query_one(Footer)
        wide = width >= PALETTE_MIN_WIDTH
        if footer.show_command_palette != wide:
            footer.show_command_palette = wide
            footer.refresh(recompose=True)

    def on_mount(self) -> None:
        self._fit_footer(self.size.width)
        table = self.query_one(DataTable)
        for c in COLUMNS:
            table.add_column(c.title, key=c.title)
        table.fixed_columns = 2  # experiment and run stay in view when the table scrolls sideways
        table.focus()
        if self.state.message:  # what the dashboard ended with, once this screen is shown
            self.call_after_refresh(self.notify, self.state.message, timeout=10)
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
        before = [s.path for s in self.shown]
        self.shown = ordered(rows, col, self.state.reverse)
        header = best_header(self.shown)
        self._set_label(table, BEST, header)
        starred = "*" in header
        marked = set(self.state.marked)
        table_rows = []
        for s in self.shown:
            cells = [c.cell(s, self.root) for c in COLUMNS]
            cells[[c.title for c in COLUMNS].index(BEST)] = _best_cell(s, starred)
            if s.path in marked:
                cells[0] = Text("● " + s.name, style="bold")
            table_rows.append(cells)
        if before == [s.path for s in self.shown] and table.row_count == len(self.shown):
            # The same rows in the same order: their cells change in place, so the table stays
            # scrolled where the user left it.
            for s, cells in zip(self.shown, table_rows, strict=True):
                for c, value in zip(COLUMNS, cells, strict=True):
                    table.update_cell(str(s.path), c.title, value, update_width=True)
        else:
            table.clear()
            for s, cells in zip(self.shown, table_rows, strict=True):
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
            f" · sorted by {header if col.title == BEST else col.title} {arrow}"
            f" · marked {len(self.state.marked)} · enter: dashboard")
        self._show_detail()

    @staticmethod
    def _set_label(table: DataTable, key: str, label: str) -> None:
        column = table.columns.get(key)  # type: ignore[call-overload]
        if column is not None and column.label.plain != label:
            column.label = Text(label)
            column.content_width = max(column.content_width, len(label))
            table.refresh()

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
        text = Text(str(s.path), style="dim")
        for line, style in ((settings_line(s), "dim"),
                            (f"{s.health}: {s.health_reason}" if s.health_reason else "",
                             HEALTH_STYLE.get(s.health, "")),
                            (f"note: {s.notes.note}" if s.notes.note else "", ""),
                            (s.note, "dim")):
            if line:
                text.append("\n" + line, style=style)
        detail.update(text)

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
            self.notify("mark two or more runs (m), then v to compare them", severity="warning", markup=False)
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
        self.query_one("#runs-filter", Input).focus()

    def action_edit_note(self) -> None:
        s = self.current()
        if s is not None:
            self.app.push_screen(
                EditScreen(f"note on {_rel(s, self.root)}", s.notes.note,
                           f"one line, kept in {s.path.name}/notes.json · enter: keep · "
                           "escape: leave as it was"),
                lambda text: self._keep_notes(s, text, None))

    def action_edit_tags(self) -> None:
        s = self.current()
        if s is not None:
            self.app.push_screen(
                EditScreen(f"tags of {_rel(s, self.root)}", " ".join(s.notes.tags),
                           "words separated by spaces or commas (#tag in the filter keeps "
                           "runs with it) · enter: keep · escape: leave as they were"),
                lambda text: self._keep_notes(s, None, text))

    def _keep_notes(self, s: RunSummary, note: str | None, tags: str | None) -> None:
        """Write what the user typed into the run's notes.json; one line when it cannot be."""
        if note is None and tags is None:
            return
        try:
            new = RunNotes(parse_note(note) if note is not None else s.notes.note,
                           parse_tags(tags) if tags is not None else s.notes.tags)
            if new != s.notes:
                write_notes(s.path, new)
        except NotesError as e:
            self.notify(str(e), severity="error", title="not kept", markup=False)
            return
        self.summaries = [replace(x, notes=new) if x.path == s.path else x
                          for x in self.summaries]
        self._render_table()

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
        user_settings.keep_theme(self)
        self.push_screen(RunsScreen(self.root, self.browser_state, self.scanner))
