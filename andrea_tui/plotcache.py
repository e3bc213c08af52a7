"""CachedPlot: a plotext chart that builds only when its picture changed, drawn straight to strips.

A plotext build costs milliseconds, so a chart builds only when what it would draw changed: a
subclass hands its data to `_set_inputs`, which ignores data equal to what is drawn, and the
picture is kept while (data, size, theme) are the same (Textual re-renders widgets for reasons
of its own, e.g. when a pushed screen is popped). The picture goes from plotext's character
matrix straight to Textual strips, not through plotext's ANSI string; `build_seconds` lets the
app budget redraws. Its frame, titles and tick labels take the app theme's foreground on its
surface (the ANSI themes, whose colours are the terminal's own, leave them to the terminal), and
`colors` is the line palette for the theme's background. The charts are andrea_tui.charts
(dashboard) and andrea_tui.compare_screen (the compare overlay).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
from plotext._dict import themes as plotext_themes
from rich.text import Text
from textual import events
from textual.color import Color
from textual.content import Content, Span
from textual.strip import Strip
from textual.style import Style as TStyle
from textual_plotext import PlotextPlot

from andrea_tui.chartparts import DARK, LIGHT, LineColor
from andrea_tui.strips import fitting_strip, plain_line, plain_widget


def _same(a: tuple | None, b: tuple) -> bool:
    """Whether two chart inputs (tuples of arrays and scalars) would draw the same picture."""
    if a is None or len(a) != len(b):
        return False
    for u, v in zip(a, b, strict=True):
        if isinstance(u, np.ndarray) or isinstance(v, np.ndarray):
            if not np.array_equal(u, v, equal_nan=True):
                return False
        elif u != v:
            return False
    return True


def _plotext_color(value: str) -> str | tuple[int, int, int]:
    """A theme colour (a Textual CSS value) as plotext takes it: RGB, or `default` (the
    terminal's own) for ANSI colours and transparency, which have no RGB of their own."""
    color = Color.parse(value)
    if color.ansi is not None or color.a < 1.0:
        return "default"
    return color.rgb


# what reading plotext's internals raises when they are not as plotext 5.3.2 has them
PLOTEXT_INTERNALS = (AttributeError, TypeError, IndexError, KeyError, ImportError)


class CachedPlot(PlotextPlot):
    """A PlotextPlot that builds only when its inputs, size or theme changed, and draws plotext's
    character matrix straight into strips (a row drawn as before keeps its strip).

    PlotextPlot renders plotext's ANSI string, which Rich then parses back into a Text and
    Textual splits and styles line by line: half of a build's cost, measured (5-6 of 11 ms a
    chart at 140x45, and the largest share of the dashboard's CPU while following a run). Here
    each row of the matrix becomes one Content (a span per run of one colour: each colour's
    style is converted once, through the same ANSI -> Rich -> Textual path) and is drawn as
    Textual draws a line that fits (strips.fitting_strip): the same strips, at a fraction of
    the cost. Rows that would not fit, and a text selection, take Textual's own path (`render`).
    """

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self._data: tuple | None = None
        self._inputs: tuple | None = None  # everything the picture depends on besides size
        self._data_version = 0
        self._canvas_key: tuple | None = None  # what the plotext matrix was built for
        self._canvas: Text | None = None  # the matrix as Rich Text (built only when asked for)
        self._rows: list[Content] = []  # the matrix, one Content per row (top first)
        self._strips_key: tuple | None = None
        self._strips: list[Strip] | None = None  # None: a row does not fit (Textual's path)
        self._strip_rows: list[tuple] = []  # (y, text, spans) each strip was drawn from
        self._styles: dict[tuple, TStyle | None] = {}  # plotext (fg, style, bg) -> its style
        # False once plotext's internals (the matrix and its helpers, plotext 5.3.2, the
        # version pyproject pins) were not as this class reads them: PlotextPlot draws instead
        self._matrix_ok = True
        self.build_seconds = 0.0  # cost of the last build (plotext + strips)
        self._again: Callable[[], None] | None = None  # the last update_from, to run again

    # ------------------------------------------------------------ theme

    def _register_theme(self, app_theme_name: str) -> None:
        """A theme change (PlotextPlot subscribes to it): the next build takes the new one."""
        self.refresh()

    def _get_plotext_theme_name(self, app_theme_name: str) -> str:
        """The plotext theme for the app theme: frame, titles and ticks in the theme's
        foreground on its surface (registered with plotext the first time)."""
        if self.theme != "auto":
            return self.theme
        name = f"andrea-{app_theme_name}"
        if name not in plotext_themes:
            theme = self.app.get_theme(app_theme_name)
            colors = theme.to_color_system().generate() if theme else {}
            surface = _plotext_color(colors.get("surface", "transparent"))
            foreground = _plotext_color(colors.get("foreground", "ansi_default"))
            plotext_themes[name] = [surface, surface, foreground, "default",
                                    list(plotext_themes["default"][4])]
        return name

    @property
    def colors(self) -> dict[str, LineColor]:
        """The line colours for the app theme: names (the terminal's own colours on ANSI
        themes), RGB on a light background."""
        fg = self.app.theme_variables.get("foreground")
        ansi = fg is not None and Color.parse(fg).ansi is not None
        return DARK if self.app.current_theme.dark or ansi else LIGHT

    def on_resize(self, event: events.Resize) -> None:
        """A new size: the data again for its width (the columns it is downsampled to), at
        once rather than at the app's next redraw; then what the chart's column does when
        its height changes (`column_resized`)."""
        if self._again is not None:
            self._again()
        self.column_resized()

    def column_resized(self) -> None:
        """The chart was resized with the column it is in: what else in that column follows
        from the column's new size. Nothing for a chart alone in its column; the dashboard's
        charts above the learning-rate chart show or hide it (charts.ColumnChart)."""

    def _set_inputs(self, inputs: tuple, data: tuple) -> bool:
        """Store new inputs and refresh; False (and nothing done) when they draw the same."""
        if _same(self._inputs, inputs):
            return False
        self._inputs, self._data = inputs, data
        self._data_version += 1
        self.refresh()
        return True

    def _draw(self) -> None:
        """Issue the plotext calls for the current data (subclasses)."""
        raise NotImplementedError

    def _build(self) -> bool:
        """Build plotext's matrix for the current data, size and theme (unless it is built);
        True if it was built now."""
        key = (self._data_version, self.size, self.app.theme, self.theme)
        if key == self._canvas_key:
            return False
        if self._canvas_key is not None and self._canvas_key[2:] != key[2:]:
            self._styles.clear()  # colours convert for the theme they are drawn in
        plt = self.plt
        plt.clear_data()
        plt.clear_figure()
        self._draw()
        # What PlotextPlot.render does before plotext's build(), which would also write the
        # ANSI string (matrix.set_canvas): that is left for `render`, when it is asked for.
        width, height = self.size
        plt.plotsize(width, height)
        plt._set_size(width, height)
        plt.theme(self._get_plotext_theme_name(self.app.theme))
        plt._set_sizes()
        plt._build_matrix()
        self._rows = self._matrix_rows()
        self._canvas_key, self._canvas = key, None  # the strips' key holds this one
        return True

    def _matrix_rows(self) -> list[Content]:
        """plotext's matrix (rows bottom first) as one Content per row, top first."""
        m = self.plt.monitor.matrix
        rows = []
        for r in reversed(m.Rows):
            marker, fg, st, bg = m.marker[r], m.fullground[r], m.style[r], m.background[r]
            spans, start, n = [], 0, len(marker)
            for c in range(1, n + 1):
                if c == n or fg[c] != fg[start] or st[c] != st[start] or bg[c] != bg[start]:
                    style = self._style_of(fg[start], st[start], bg[start])
                    if style is not None:
                        spans.append(Span(start, c, style))
                    start = c
            rows.append(Content("".join(marker), spans))
        return rows

    def _style_of(self, fg: object, st: object, bg: object) -> TStyle | None:
        """The Textual style of a cell of plotext colours (fullground, style, background): what
        PlotextPlot's path (plotext's ANSI codes, Text.from_ansi, Content.from_rich_text) gives
        it, worked out once per colour."""
        key = tuple(tuple(c) if isinstance(c, list) else c for c in (fg, st, bg))
        if key not in self._styles:
            from plotext import _utility  # plotext's own colour codes (a private module)

            ansi = _utility.colors_to_ansi(fg, st, bg)
            text = Text.from_ansi(f"{ansi}x{_utility.ansi_end}" if ansi else "x")
            spans = Content.from_rich_text(text, console=self.app.console).spans
            self._styles[key] = spans[0].style if spans else None  # type: ignore[assignment]
        return self._styles[key]

    def _give_up_matrix(self, e: Exception) -> None:
        self._matrix_ok = False
        self._canvas_key = self._strips_key = self._strips = None
        self.app.log.warning(f"chart {self.id}: plotext's matrix is not as plotext 5.3.2 has "
                             f"it ({type(e).__name__}: {e}); drawn through PlotextPlot")

    def _picture(self) -> list[Strip] | None:
        """The rows as strips, built when stale; None where Textual's own path must draw them
        (a row that does not fit, or a text selection)."""
        if not plain_widget(self) or not self._matrix_ok:
            return None
        try:
            return self._strips_of_matrix()
        except PLOTEXT_INTERNALS as e:
            self._give_up_matrix(e)
            return None

    def _strips_of_matrix(self) -> list[Strip] | None:
        t0 = time.perf_counter()
        built = self._build()
        width, style = self.size.width, self.visual_style
        key = (self._canvas_key, width, style)
        if key != self._strips_key:
            # A row drawn the same as before keeps its strip: following a long run, a redraw
            # changes 1-3 rows of 15 (an axis label, the newest column), measured at 200k steps.
            old: dict[tuple, Strip] = {}
            if self._strips is not None and self._strips_key is not None \
                    and self._strips_key[1:] == key[1:]:
                old = dict(zip(self._strip_rows, self._strips, strict=True))
            self._strips_key = key
            self._strips = None
            self._strip_rows = [(y, row.plain, tuple(row.spans))
                                for y, row in enumerate(self._rows)]
            if all(row.cell_length <= width and plain_line(row) for row in self._rows):
                self._strips = [old.get(k) or fitting_strip(self, row, k[0], style)
                                for k, row in zip(self._strip_rows, self._rows, strict=True)]
        if built:
            self.build_seconds = time.perf_counter() - t0
        return self._strips

    def render_line(self, y: int) -> Strip:
        strips = self._picture()
        if strips is None:
            return super().render_line(y)  # through `render`
        if y < len(strips):
            return strips[y]
        return Strip.blank(self.size.width, self.visual_style.rich_style)

    def render(self) -> Text:
        """The picture as Rich Text: Textual's path (text selection, rows that do not fit)."""
        if self._matrix_ok:
            t0 = time.perf_counter()
            try:
                built = self._build()
                if self._canvas is None:
                    self._canvas = Text.from_ansi(self.plt.monitor.matrix.set_canvas())
                if built:
                    self.build_seconds = time.perf_counter() - t0
                return self._canvas
            except PLOTEXT_INTERNALS as e:
                self._give_up_matrix(e)
        plt = self.plt  # PlotextPlot's own path: the plot drawn again, then plotext's build
        plt.clear_data()
        plt.clear_figure()
        self._draw()
        return super().render()  # type: ignore[return-value]

