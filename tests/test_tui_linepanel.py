"""LinePanel draws what a Static draws, and repaints only the rows of the lines that changed."""

from __future__ import annotations

import asyncio

from rich.text import Text
from textual.app import App, ComposeResult
from textual.widgets import Static

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
