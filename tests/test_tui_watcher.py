"""RunWatcher: changes coalesce into the message still waiting; real watchfiles reaches an app."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

from textual.app import App

from andrea_tui.watcher import FilesChanged, RunWatcher


class Inbox:
    """Stands in for the app: keeps what is posted to it, handles nothing by itself."""

    def __init__(self) -> None:
        self.messages: list[FilesChanged] = []

    def post_message(self, message: FilesChanged) -> bool:
        self.messages.append(message)
        return True


def test_changes_while_a_message_waits_merge_into_it(tmp_path: Path) -> None:
    inbox = Inbox()
    watcher = RunWatcher(tmp_path, inbox)  # type: ignore[arg-type]
    watcher.report({"loss.jsonl"})
    watcher.report({"events.jsonl"})
    watcher.report({"loss.jsonl", "state.json"})
    assert len(inbox.messages) == 1
    assert inbox.messages[0].take() == {"loss.jsonl", "events.jsonl", "state.json"}
    # Handled: the next change is news again, in a message of its own.
    watcher.report({"samples.jsonl"})
    watcher.report({"loss.jsonl"})
    assert len(inbox.messages) == 2
    assert inbox.messages[1].take() == {"samples.jsonl", "loss.jsonl"}
    assert inbox.messages[0].take() == {"loss.jsonl", "events.jsonl", "state.json"}


def test_no_name_is_lost_when_reports_race_the_handler(tmp_path: Path) -> None:
    """The watching thread reports while the UI thread takes: every name arrives."""
    inbox = Inbox()
    watcher = RunWatcher(tmp_path, inbox)  # type: ignore[arg-type]
    names = [f"f{i}" for i in range(5000)]

    def reporter() -> None:
        for n in names:
            watcher.report({n})

    thread = threading.Thread(target=reporter)
    thread.start()
    seen: set[str] = set()
    taken = 0
    while thread.is_alive() or taken < len(inbox.messages):
        if taken < len(inbox.messages):
            seen |= inbox.messages[taken].take()
            taken += 1
    thread.join()
    assert seen == set(names)


class Watching(App[None]):
    def __init__(self, run_dir: Path) -> None:
        super().__init__()
        self.watcher = RunWatcher(run_dir, self)
        self.seen: set[str] = set()

    def on_mount(self) -> None:
        self.watcher.start()

    def on_unmount(self) -> None:
        self.watcher.stop()

    def on_files_changed(self, message: FilesChanged) -> None:
        self.seen |= message.take()


def test_real_changes_reach_the_app_as_messages(tmp_path: Path) -> None:
    async def go() -> set[str]:
        app = Watching(tmp_path)
        async with app.run_test() as pilot:
            await pilot.pause(0.3)  # the watch is set up
            (tmp_path / "loss.jsonl").write_text("{}\n")
            (tmp_path / "state.json").write_text("{}")
            deadline = time.monotonic() + 10
            while app.seen < {"loss.jsonl", "state.json"} and time.monotonic() < deadline:
                await pilot.pause(0.05)
            return app.seen

    assert asyncio.run(go()) >= {"loss.jsonl", "state.json"}

