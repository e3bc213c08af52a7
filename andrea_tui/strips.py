"""Rows of text drawn as the strips Textual would draw, without its general path where it is
not needed.

Textual draws a widget's text through Visual.to_strips (text-selection, link and alignment
passes around Content.render_strips), several times the cost of drawing a line that fits. The
dashboard draws lines of its panels (linepanel.LinePanel) and rows of its charts
(charts.CachedPlot) several times a second while following a run: these functions draw them
directly and leave what they do not cover (a text selection, links, tabs, alignment, folding) to
Textual. tests/test_tui_linepanel.py and tests/test_tui_charts.py compare the strips with
Textual's.
"""

from __future__ import annotations

from rich.segment import Segment
from rich.style import Style as RichStyle
from textual.content import Content
from textual.strip import Strip
from textual.style import Style as TStyle
from textual.visual import RenderOptions, Visual
from textual.widget import Widget


def plain_widget(widget: Widget) -> bool:
    """No text selection on `widget`, its content and text left-aligned, no line padding: the
    fast paths below apply."""
    styles = widget.styles
    return (widget.text_selection is None and styles.content_align_horizontal == "left"
            and styles.text_align in ("left", "start") and styles.line_pad == 0)


def plain_line(line: Content) -> bool:
    """No tabs, links or actions in `line`: the fast paths below apply."""
    return "\t" not in line.plain and all(
        isinstance(span.style, TStyle) and not span.style.link and not span.style.meta
        for span in line.spans)


def fitting_strip(widget: Widget, line: Content, y: int, style: TStyle) -> Strip:
    """The strip Textual's Content path draws for line `y` of `widget` (visual style `style`)
    when it fits the width, at a fraction of its cost; only for a `plain_widget` and a
    `plain_line`. Each segment carries its (x, y) offset, as Textual's do, for mouse text
    selection (y: the logical line's number)."""
    segments, x = [], 0
    for text, text_style in line.render(style, end="", parse_style=widget._get_style):
        segments.append(Segment(text, (style + text_style).rich_style_with_offset(x, y)))
        x += len(text)
    return Strip(segments, line.cell_length)


def at_line(strip: Strip, y: int) -> Strip:
    """`strip` with the line number of its segments' (x, y) offsets set to `y`: Content's own
    render counts lines from 0 within what it is given (one logical line here), a Static from
    the top of its text, and a mouse selection starting on the row reads them."""
    segments = []
    for seg in strip:
        meta = seg.style.meta if seg.style is not None else None
        if meta and "offset" in meta:
            seg = Segment(seg.text, seg.style + RichStyle.from_meta(  # type: ignore[operator]
                {"offset": (meta["offset"][0], y)}), seg.control)
        segments.append(seg)
    return Strip(segments, strip.cell_length)


def line_strips(widget: Widget, line: Content, width: int, y: int) -> list[Strip]:
    """The rows Textual draws for one logical line `line` (line number `y`) of `widget`.

    Visual.to_strips costs several times a fitting line's render (text-selection and link
    passes around Content.render_strips): measured, the header (wrapping) and the data mixture's
    first line (cut with an ellipsis), re-rendered on every frame while following a run, took
    40% of LinePanel.update. So: a line that fits is drawn by `fitting_strip`; one cut by
    `text-wrap: nowrap` is cut as Content.render_strips cuts it (Content.truncate), then drawn
    by `fitting_strip`; one that wraps goes to Content.render_strips itself; anything else
    (selection, links, tabs, alignment, folding) to Visual.to_strips."""
    if plain_widget(widget) and plain_line(line):
        style = widget.visual_style
        if line.cell_length <= width:
            return [fitting_strip(widget, line, y, style)]
        styles = widget.styles
        if styles.text_wrap != "nowrap":
            rows = line.render_strips(width, None, style, RenderOptions(widget._get_style, styles))
            return [at_line(row, y) for row in rows]
        if styles.text_overflow != "fold":
            cut = line.truncate(width, ellipsis=styles.text_overflow == "ellipsis")
            return [fitting_strip(widget, cut, y, style)]
    return Visual.to_strips(widget, line, width, None, widget.visual_style)
