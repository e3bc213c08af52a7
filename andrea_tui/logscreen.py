"""The engine log in full, with search and filter.

engine.log (its last 4 MiB, then what is appended while the screen is open). `/` opens the query
line; with a query, `n` and `N` jump to the next and previous matching line (case-insensitive),
`f` shows only the matching lines, `e` only the lines that tell of trouble (errors, warnings,
alerts, tracebacks, skipped steps). Lines are kept in memory up to MAX_LINES (the newest).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import Footer, Input, Log, Static

TROUBLE = re.compile(r"error|warning|alert|traceback|non-finite|failed|killed", re.IGNORECASE)
MAX_LINES = 50_000


class LogScreen(Screen[None]):
    """engine.log in full (its last 4 MiB), following appended lines while open."""

    BINDINGS: ClassVar[list[Binding]] = [
        Binding("escape,l,q", "back", "back"),
        Binding("slash", "search", "search"),
        Binding("n", "next(1)", "next"),
        Binding("N", "next(-1)", "previous", show=False),
        Binding("f", "filter", "filter"),
        Binding("e", "trouble", "errors only"),
    ]
    MAX_BYTES = 4 << 20

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = Path(path)
        self._offset = 0
        self.lines: list[str] = []  # every line read (the newest MAX_LINES)
        self.shown: list[str] = []  # what the Log widget holds, in order
        self.query_text = ""
        self.filtering = False
        self.trouble = False
        self.match = -1  # index into `shown` of the current match

    def compose(self) -> ComposeResult:
        yield Input(placeholder="search engine.log (enter: next match; escape: back)",
                    id="log-query")
        yield Log(max_lines=MAX_LINES, auto_scroll=True, id="fulllog")
        yield Static("", id="log-status")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one(Input).display = False
        self._read_more(first=True)
        self.set_interval(0.5, self._read_more)
        self.query_one(Log).focus()

    # ------------------------------------------------------------ what is shown

    def wanted(self, line: str) -> bool:
        if self.trouble and not TROUBLE.search(line):
            return False
        return not (self.filtering and self.query_text
                    and self.query_text.lower() not in line.lower())

    def _rebuild(self) -> None:
        log = self.query_one(Log)
        self.shown = [x for x in self.lines if self.wanted(x)]
        log.clear()
        log.write_lines(self.shown)
        self.match = -1
        self._status()

    def _status(self, extra: str = "") -> None:
        parts = []
        if self.query_text:
            n = sum(self.query_text.lower() in x.lower() for x in self.shown)
            parts.append(f"search {self.query_text!r}: {n} matching line(s)")
        if self.filtering:
            parts.append("filter: matching lines only")
        if self.trouble:
            parts.append("errors/warnings/alerts only")
        parts.append(f"{len(self.shown):,} of {len(self.lines):,} lines")
        self.query_one("#log-status", Static).update(" · ".join(parts) + (
            f"\n{extra}" if extra else ""))

    def _read_more(self, first: bool = False) -> None:
        log = self.query_one(Log)
        try:
            with open(self.path, "rb") as f:
                size = f.seek(0, 2)
                if size < self._offset:
                    self._offset = 0
                    self.lines.clear()
                    self._rebuild()
                start = max(self._offset, size - self.MAX_BYTES) if first else self._offset
                f.seek(start)
                data = f.read(self.MAX_BYTES)  # a log that grew by gigabytes: a bite a tick
        except OSError as e:
            if first:
                log.write_line(f"{self.path}: {e.strerror or e}")
            return
        cut = data.rfind(b"\n") + 1  # keep a torn last line for the next read
        self._offset = start + cut
        if not cut:
            if first:
                self._status()
            return
        new = data[:cut].decode("utf-8", "replace").splitlines()
        self.lines.extend(new)
        if len(self.lines) > MAX_LINES:
            del self.lines[: len(self.lines) - MAX_LINES]
        add = [x for x in new if self.wanted(x)]
        self.shown.extend(add)
        if len(self.shown) > MAX_LINES:
            del self.shown[: len(self.shown) - MAX_LINES]
        log.write_lines(add)
        self._status()

    # ------------------------------------------------------------ keys

    def action_back(self) -> None:
        self.app.pop_screen()

    def action_search(self) -> None:
        box = self.query_one(Input)
        box.display = True
        box.focus()

    def on_input_changed(self, event: Input.Changed) -> None:
        self.query_text = event.value
        if self.filtering:
            self._rebuild()
        else:
            self._status()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.query_one(Log).focus()
        self.action_next(1)

    def on_key(self, event) -> None:
        box = self.query_one(Input)
        if event.key == "escape" and box.has_focus:
            event.stop()
            box.display = bool(box.value)
            self.query_one(Log).focus()

    def action_next(self, direction: int) -> None:
        """Jump to the next (1) or previous (-1) line holding the query."""
        q = self.query_text.lower()
        if not q:
            self.action_search()
            return
        hits = [i for i, x in enumerate(self.shown) if q in x.lower()]
        if not hits:
            self._status("no match")
            return
        if direction > 0:
            self.match = next((i for i in hits if i > self.match), hits[0])
        else:
            self.match = next((i for i in reversed(hits) if i < self.match), hits[-1])
        log = self.query_one(Log)
        log.auto_scroll = False
        log.scroll_to(y=max(0, self.match - 3), animate=False)
        self._status(f"match {hits.index(self.match) + 1}/{len(hits)} (line "
                     f"{self.match + 1}): {self.shown[self.match][:200]}")

    def action_filter(self) -> None:
        self.filtering = not self.filtering
        self._rebuild()

    def action_trouble(self) -> None:
        self.trouble = not self.trouble
        self._rebuild()
