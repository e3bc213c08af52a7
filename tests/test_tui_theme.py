"""The colour theme a user picks (Textual's, from the command palette) is kept with the other
settings (andrea_tui.settings) and restored at the next start, by the dashboard and the runs
browser alike; a damaged or unknown theme in the file leaves Textual's default."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from andrea_tui import settings as user_settings
from andrea_tui.settings import Settings
from tests.fakerun import write_run
from tests.test_tui_app import finished_run_app, wait_until


def kept() -> dict:
    return json.loads(user_settings.settings_path().read_text())


def test_the_theme_field_reads_only_a_name() -> None:
    assert Settings.from_json({"theme": "nord"}).theme == "nord"
    for bad in (5, "", "../x", "a b", "x" * 65, None):
        assert Settings.from_json({"theme": bad}).theme == "", bad
    assert Settings().themed("gruvbox") == Settings(theme="gruvbox")


def test_the_dashboard_restores_the_kept_theme_and_keeps_a_new_one(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", 50).root
    user_settings.save(Settings(theme="textual-light", bell=False))

    async def go() -> None:
        async with finished_run_app(run) as (app, pilot):
            assert app.theme == "textual-light"
            app.theme = "nord"  # what the command palette's "Change theme" does
            await wait_until(pilot, lambda: kept().get("theme") == "nord")
            await pilot.press("y")  # a chart choice written after keeps the theme
            await pilot.pause()
            assert kept()["theme"] == "nord" and kept()["log_y_loss"] is True
            assert kept()["bell"] is False
        async with finished_run_app(run) as (again, _):
            assert again.theme == "nord"

    asyncio.run(go())


def test_the_runs_browser_restores_and_keeps_the_theme(tmp_path: Path) -> None:
    from andrea_tui.runs_screen import RunsApp

    write_run(tmp_path / "runs" / "a", 20)
    user_settings.save(Settings(theme="gruvbox", smoothing=0.95))

    async def go() -> None:
        app = RunsApp(tmp_path / "runs")
        async with app.run_test(size=(120, 30)) as pilot:
            await pilot.pause()
            assert app.theme == "gruvbox"
            app.theme = "textual-light"
            await wait_until(pilot, lambda: kept().get("theme") == "textual-light")
        assert kept()["smoothing"] == 0.95  # the other choices stay

    asyncio.run(go())


def test_an_unknown_theme_leaves_the_default(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", 20).root
    user_settings.settings_path().parent.mkdir(parents=True, exist_ok=True)
    user_settings.settings_path().write_text('{"theme": "not-a-theme-here"}')

    async def go() -> None:
        async with finished_run_app(run) as (app, pilot):
            assert app.theme == "textual-dark"
            await pilot.pause()
            assert kept()["theme"] == "not-a-theme-here"  # not rewritten by the start

    asyncio.run(go())


def test_the_compare_and_checkpoint_apps_restore_and_keep_the_theme(tmp_path: Path) -> None:
    from andrea_tui.ckpt_screens import CheckpointApp
    from andrea_tui.compare_screen import CompareApp

    a, b = write_run(tmp_path / "a", 20).root, write_run(tmp_path / "b", 20).root
    (tmp_path / "ckpts").mkdir()
    user_settings.save(Settings(theme="gruvbox"))

    async def go() -> None:
        for app in (CompareApp([a, b]), CheckpointApp(tmp_path / "ckpts")):
            async with app.run_test(size=(120, 30)) as pilot:
                await pilot.pause()
                assert app.theme == "gruvbox", type(app).__name__
                app.theme = "nord"
                await wait_until(pilot, lambda: kept().get("theme") == "nord")
            user_settings.save(Settings(theme="gruvbox"))

    asyncio.run(go())
