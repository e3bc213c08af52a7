"""LinePanel draws what a Static draws, and repaints only the rows of the lines that changed."""

from __future__ import annotations

import asyncio

import pytest
from rich.text import Text
from textual.app import App, ComposeResult
from textual.widgets import Static

from andrea_tui import strips
from andrea_tui.linepanel import LinePanel
from andrea_tui.screentext import screen_text

CSS = """
LinePanel, Static { height: auto; width: 30; border: round red; padding: 0 1; }
.cut { text-wrap: nowrap; text-overflow: ellipsis; }
"""


class Pair(App):
    CSS = CSS

    def compose(self) -> ComposeResult:
        yield LinePanel(id="lp", classes="cut")
        yield Static(id="st", classes="cut")
        yield LinePanel(id="wrap")
        yield Static(id="wst")


def sample(n: int) -> Text:
    t = Text.from_markup(f"[bold]step {n}[/] · fixed\nsecond line\n")
    t.append("a line far too long to fit in the panel width", style="red")
    t.append(f"\nlast {n}")
    return t


def rows(app: App, wid: str) -> list[str]:
    w = app.query_one(f"#{wid}")
    lines = screen_text(app).splitlines()
    return [ln[w.region.x:w.region.right] for ln in lines[w.region.y:w.region.bottom]]


def test_linepanel_matches_static_and_repaints_changed_rows() -> None:
    async def go() -> None:
        app = Pair()
        async with app.run_test(size=(40, 30)) as pilot:
            lp, st = app.query_one("#lp", LinePanel), app.query_one("#st", Static)
            wrap, wst = app.query_one("#wrap", LinePanel), app.query_one("#wst", Static)
            for n in (1, 22):
                for w in (lp, st, wrap, wst):
                    w.update(sample(n))
                await pilot.pause()
                assert rows(app, "lp") == rows(app, "st")
                assert rows(app, "wrap") == rows(app, "wst")  # wrapped lines: same rows
                assert f"step {n}" in rows(app, "lp")[1]
            # Only line 0 and line 3 change: only their rows are marked for repaint.
            lp._repaint_regions.clear()
            lp.update(sample(333))
            dirty = sorted(r.y for r in lp._repaint_regions)
            off = lp.content_offset.y
            assert dirty == [off + 0, off + 3]
            await pilot.pause()
            assert rows(app, "lp")[1].strip(" │╭╮").startswith("step 333")
            assert "last 333" in rows(app, "lp")[4]

    asyncio.run(go())


class NoVisualPath:
    """Stands in for Textual's Visual in andrea_tui.strips: the fast paths must not need it."""

    @staticmethod
    def to_strips(*args, **kwargs):
        raise AssertionError("Visual.to_strips called: the fast path was not taken")


def test_linepanel_strips_are_static_strips_with_styles(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not only the text: every row's segments and styles are what a Static draws, for lines
    that fit, lines cut with an ellipsis (text-wrap: nowrap) and lines that wrap, all drawn
    without Textual's Visual path."""
    monkeypatch.setattr(strips, "Visual", NoVisualPath)

    async def go() -> None:
        app = Pair()
        async with app.run_test(size=(40, 30)) as pilot:
            for n in (1, 4444):
                for wid in ("lp", "st", "wrap", "wst"):
                    app.query_one(f"#{wid}").update(sample(n))
                await pilot.pause()
                for mine, static in (("lp", "st"), ("wrap", "wst")):
                    lp, st = app.query_one(f"#{mine}", LinePanel), app.query_one(f"#{static}")
                    assert lp.size == st.size
                    got = [lp.render_line(y) for y in range(lp.size.height)]
                    want = [st.render_line(y) for y in range(st.size.height)]
                    assert any(seg.style and seg.style.color for s in got for seg in s)
                    # offsets included: a wrapped line's rows carry its line number, as a
                    # Static's do (a mouse selection starting there reads them)
                    assert got == want, mine

    asyncio.run(go())


def test_selected_text_is_drawn_and_copied_as_a_static_does() -> None:
    """A text selection over fitting, cut and wrapped lines: the same highlighted rows as a
    Static's, and the same text copied (Screen.get_selected_text: it crashed on a LinePanel,
    whose own `_render` hid the one Textual's selection calls)."""
    from textual.geometry import Offset
    from textual.selection import Selection

    async def go() -> None:
        app = Pair()
        async with app.run_test(size=(40, 30)) as pilot:
            for wid in ("lp", "st", "wrap", "wst"):
                app.query_one(f"#{wid}").update(sample(7))
            await pilot.pause()
            for mine, static in (("lp", "st"), ("wrap", "wst")):
                lp, st = app.query_one(f"#{mine}", LinePanel), app.query_one(f"#{static}")
                sel = Selection(Offset(2, 0), Offset(9, 2))
                app.screen.selections = {lp: sel, st: sel}
                await pilot.pause()
                got = [lp.render_line(y) for y in range(lp.size.height)]
                want = [st.render_line(y) for y in range(st.size.height)]
                assert got == want, mine
                assert lp.get_selection(sel) == st.get_selection(sel)
                assert app.screen.get_selected_text()
                lp.update(sample(8))  # a step arrives while text is selected
                st.update(sample(8))
                await pilot.pause()
                assert [lp.render_line(y) for y in range(lp.size.height)] == \
                    [st.render_line(y) for y in range(st.size.height)], mine
                longer = sample(9)
                longer.append("\none line more")  # the line count changes while selected
                lp.update(longer)
                st.update(longer)
                await pilot.pause()
                assert [lp.render_line(y) for y in range(lp.size.height)] == \
                    [st.render_line(y) for y in range(st.size.height)], mine
                app.screen.selections = {}
                await pilot.pause()

    asyncio.run(go())


def test_a_panel_off_the_screen_takes_updates_and_draws_them_once_back() -> None:
    """A timer can redraw the dashboard while the app tears its screens down (seen under load:
    Textual's NoScreen from the text-selection lookup). Off the screen an update keeps the text;
    mounted again, the panel draws the last one."""
    async def go() -> None:
        app = Pair()
        async with app.run_test(size=(40, 30)) as pilot:
            lp, st = app.query_one("#lp", LinePanel), app.query_one("#st", Static)
            lp.update(sample(1))
            await pilot.pause()
            await lp.remove()
            for n in (2, 3):  # same line count: the row-by-row path, which asks for the screen
                lp.update(sample(n))
            await app.mount(lp, before=st)
            st.update(sample(3))
            await pilot.pause()
            assert rows(app, "lp") == rows(app, "st")
            assert "step 3" in rows(app, "lp")[1]

    asyncio.run(go())
