"""FramePacer: one frame per interval at most, reading the union of what changed."""

from __future__ import annotations

import asyncio
from collections.abc import Collection

from andrea_tui.pacing import FramePacer


class Report:
    """A report of changed names (as watcher.FilesChanged): grows until taken."""

    def __init__(self, *names: str) -> None:
        self.names = set(names)
        self.taken = False

    def take(self) -> set[str]:
        self.taken = True
        return set(self.names)


class Frames:
    """Records the pacer's reads and draws; every read says the state changed."""

    def __init__(self) -> None:
        self.reads: list[set[str] | None] = []
        self.draws = 0

    def read(self, files: Collection[str] | None) -> bool:
        self.reads.append(None if files is None else set(files))
        return True

    def draw(self) -> None:
        self.draws += 1


def pacer_for(frames: Frames, interval: float = 0.2) -> FramePacer:
    pacer = FramePacer(frames.read, frames.draw, min_interval=interval)
    pacer.reading = True
    return pacer


def test_changes_within_an_interval_make_one_frame_at_its_end() -> None:
    async def go() -> None:
        frames = Frames()
        pacer = pacer_for(frames)
        first = Report("loss.jsonl")
        pacer.files_changed(first)  # the first change is shown at once
        assert first.taken and frames.reads == [{"loss.jsonl"}] and frames.draws == 1
        report = Report("loss.jsonl")
        pacer.files_changed(report)
        pacer.request()
        assert frames.draws == 1  # too soon: it waits for the end of the interval...
        assert not report.taken
        report.names.add("events.jsonl")  # ...and so the watcher adds to the same report
        pacer.files_changed(Report("state.json"))  # (a report posted all the same)
        await asyncio.sleep(0.3)
        assert report.taken
        assert frames.reads == [{"loss.jsonl"}, {"loss.jsonl", "events.jsonl", "state.json"}]
        assert frames.draws == 2
        pacer.cancel()

    asyncio.run(go())


def test_nothing_is_read_before_reading_starts_and_nothing_is_lost() -> None:
    """Until the history is in place the files stay pending; a full poll then reads all."""

    async def go() -> None:
        frames = Frames()
        pacer = FramePacer(frames.read, frames.draw, min_interval=0.0)
        early = Report("loss.jsonl")
        pacer.files_changed(early)
        assert not pacer.poll_all() and frames.reads == [] and not early.taken
        pacer.reading = True
        pacer.files_changed(Report("state.json"))  # still "all": a full poll was asked for
        assert frames.reads == [None] and early.taken
        pacer.files_changed(Report("state.json"))
        assert frames.reads == [None, {"state.json"}]

    asyncio.run(go())


def test_draw_now_reads_what_is_pending_and_drops_the_scheduled_frame() -> None:
    async def go() -> None:
        frames = Frames()
        pacer = pacer_for(frames)
        pacer.draw_now()
        pacer.files_changed(Report("samples.jsonl"))  # scheduled for the interval's end
        pacer.draw_now()
        assert frames.reads == [{"samples.jsonl"}] and frames.draws == 2
        await asyncio.sleep(0.3)
        assert frames.draws == 2  # the scheduled frame was dropped: nothing left to show

    asyncio.run(go())


def test_a_backlog_read_frame_by_frame_draws_at_most_once_an_interval() -> None:
    """Each read leaves bytes for later (a backlog re-reports its file from inside the read):
    the reads go on on the loop, but the panels are drawn at most once per interval."""

    class Backlog(Frames):
        pacer: FramePacer

        def read(self, files: Collection[str] | None) -> bool:
            super().read(files)
            self.pacer.files_changed(Report("events.jsonl"))  # bytes left: read again soon
            return True

    async def go() -> None:
        frames = Backlog()
        frames.pacer = pacer = pacer_for(frames, interval=0.1)
        pacer.files_changed(Report("events.jsonl"))
        await asyncio.sleep(1.0)
        pacer.reading = False  # the backlog ends
        pacer.cancel()
        assert len(frames.reads) >= 2  # it was read on, frame after frame
        assert frames.draws <= 1.0 / 0.1 + 2, (frames.draws, len(frames.reads))

    asyncio.run(go())
