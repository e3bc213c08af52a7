"""A text panel that repaints only the lines whose text changed.

A `Static` re-renders all of its content on every update, and Textual then re-styles every row
of it. The per-step panels (header, training, data mixture) change a few lines per step, several
times a second while following a run, so this widget keeps each logical line's rendered strips
and hands Textual only the rows of the lines that changed: a frame costs a few line renders
instead of whole panels. Lines are drawn as Textual's Content path draws them (the widget's CSS:
colours, wrapping, text-overflow; andrea_tui.strips), so what is drawn is what a Static would
draw.
"""

from __future__ import annotations

from rich.text import Text
from textual.content import Content
from textual.geometry import Region, Size
from textual.strip import Strip
from textual.visual import Visual
from textual.widget import Widget

from andrea_tui.strips import line_strips


class LinePanel(Widget):
    """Shows a Rich Text; `update()` repaints only the changed lines (re-layout only when the
    number of rows changes)."""

    DEFAULT_CSS = """
    LinePanel {
        height: auto;
    }
    """

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self._keys: list[tuple] = []  # (plain, spans, style) of each logical line
        self._lines: list[Content] = []
        self._rows: list[list[Strip] | None] = []  # rendered rows of each line, None = stale
        self._rows_for: tuple | None = None  # (width, style) the rendered rows are valid for
        # while text is selected: the whole text drawn by Textual's Visual path (one pass, so
        # the highlight and each row's line offsets are a Static's), and what it was drawn for
        self._selected_rows: list[Strip] | None = None
        self._selected_for: tuple | None = None

    # ------------------------------------------------------------ content

    def update(self, text: Text | str) -> None:
        """Show `text` (a str is taken as plain text)."""
        if isinstance(text, str):
            text = Text(text)
        lines = text.split("\n", allow_blank=True)
        keys = [(ln.plain, tuple(ln.spans), str(ln.style)) for ln in lines]
        if len(keys) != len(self._keys) or not self.is_attached:  # detached: laid out on mount
            self._keys = keys
            self._lines = [self._content(ln) for ln in lines]
            self._rows = [None] * len(lines)
            self._selected_rows = None
            self.refresh(layout=True)
            return
        changed = [i for i, (a, b) in enumerate(zip(self._keys, keys, strict=True)) if a != b]
        if not changed:
            return
        self._keys = keys
        if self.text_selection is not None:  # drawn whole (render_line): draw it again
            for i in changed:
                self._lines[i] = self._content(lines[i])
                self._rows[i] = None
            self._selected_rows = None
            self.refresh(layout=True)
            return
        width = self.size.width
        valid = self._rows_for == (width, self.visual_style)
        old_rows = [len(r) if r is not None else -1 for r in self._rows]
        for i in changed:
            self._lines[i] = self._content(lines[i])
            self._rows[i] = self._line_rows(i, width) if valid else None
        if not valid or any(len(self._rows[i] or ()) != old_rows[i] for i in changed):
            self.refresh(layout=True)  # a line now wraps to a different number of rows
            return
        starts = self._row_starts(width)
        self.refresh(*(Region(0, starts[i], width, old_rows[i]) for i in changed))

    def _content(self, line: Text) -> Content:
        return Content.from_rich_text(line, console=self.app.console)

    # ------------------------------------------------------------ rendering

    # (not `_render`: Textual's Widget._render, which its text selection calls, must stay)
    def _line_rows(self, i: int, width: int) -> list[Strip]:
        strips = line_strips(self, self._lines[i], width, i)
        return strips or [Strip.blank(width, self.visual_style.rich_style)]

    def _ensure_rows(self, width: int | None = None) -> list[list[Strip]]:
        key = (self.size.width if width is None else width, self.visual_style)
        if key != self._rows_for:
            self._rows = [None] * len(self._lines)
            self._rows_for = key
        for i, rows in enumerate(self._rows):
            if rows is None:
                self._rows[i] = self._line_rows(i, key[0])
        return self._rows  # type: ignore[return-value]

    def _row_starts(self, width: int) -> list[int]:
        starts, y = [], 0
        for rows in self._ensure_rows(width):
            starts.append(y)
            y += len(rows)
        return starts

    def render_line(self, y: int) -> Strip:
        if self.text_selection is not None:
            rows = self._rows_with_selection()
            if y < len(rows):
                return rows[y]
            return Strip.blank(self.size.width, self.visual_style.rich_style)
        for rows in self._ensure_rows():
            if y < len(rows):
                return rows[y]
            y -= len(rows)
        return Strip.blank(self.size.width, self.visual_style.rich_style)

    def _rows_with_selection(self) -> list[Strip]:
        key = (self.size.width, self.visual_style)
        if self._selected_rows is None or self._selected_for != key:
            self._selected_rows = Visual.to_strips(self, self.render(), key[0], None, key[1])
            self._selected_for = key
        return self._selected_rows

    def render(self) -> Content:
        """The whole text, for Textual's text selection (drawing goes through render_line)."""
        return Content("\n").join(self._lines)

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        return sum(len(rows) for rows in self._ensure_rows(width))

    def get_content_width(self, container: Size, viewport: Size) -> int:
        return max((line.cell_length for line in self._lines), default=0)

    def notify_style_update(self) -> None:
        self._rows_for = None  # colours come from CSS: render again with the new style
        super().notify_style_update()

    def selection_updated(self, selection) -> None:
        self._rows_for = None
        self._selected_rows = None
        super().selection_updated(selection)
