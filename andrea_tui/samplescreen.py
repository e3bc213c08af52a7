"""Every sample the engine generated (samples.jsonl), by step and prompt.

A table of (step, prompt, the text's start), one row per sample, the later record winning for a
(step, prompt) a resume wrote again; the highlighted sample's whole text below it. `o` orders the
rows by prompt then step (each prompt's texts one after the other, to watch one prompt improve)
or by step. New samples appear while the screen is open.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Static

from engine import records as rec
from engine.runfiles import JsonlTail

PREVIEW = 80  # characters of a text in the table
READ_BYTES = 4 << 20  # what one tick reads of samples.jsonl


class SamplesScreen(Screen[None]):
    BINDINGS: ClassVar[list[Binding]] = [
        Binding("escape,p,q", "app.pop_screen", "back"),
        Binding("o", "order", "order: step / prompt"),
    ]

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.tail = JsonlTail(Path(path))
        self.samples: dict[tuple[int, str], rec.Sample] = {}
        self.by_prompt = False
        self.order: list[tuple[int, str]] = []

    def compose(self) -> ComposeResult:
        yield DataTable(id="samples-table", cursor_type="row", zebra_stripes=True)
        yield Static("", id="sample-detail")
        yield Footer()

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        table.add_columns("step", "prompt", "text")
        self._read()
        self.set_interval(1.0, self._read)

    def _read(self) -> None:
        objects = self.tail.read_new(READ_BYTES)
        samples, _ = rec.parse_all(rec.Sample, objects)
        if self.tail.reset:
            self.samples.clear()
        if not samples and not self.tail.reset and self.order:
            return
        for s in samples:
            self.samples[(s.step if s.step is not None else -1, s.prompt)] = s
        self._fill()

    def _key(self, k: tuple[int, str]) -> tuple:
        return (k[1], k[0]) if self.by_prompt else k

    def _fill(self) -> None:
        table = self.query_one(DataTable)
        keep = table.cursor_row
        table.clear()
        self.order = sorted(self.samples, key=self._key)
        for k in self.order:
            s = self.samples[k]
            text = s.text.replace("\n", "⏎ ")
            table.add_row(f"{k[0]:,}" if k[0] >= 0 else "–", Text(repr(s.prompt)[:30]),
                          Text(text[:PREVIEW] + ("…" if len(text) > PREVIEW else "")))
        if self.order:
            table.move_cursor(row=min(keep, len(self.order) - 1) if keep else len(self.order) - 1)
        self._detail()

    def _detail(self) -> None:
        box = self.query_one("#sample-detail", Static)
        table = self.query_one(DataTable)
        if not self.order:
            box.update(Text("no samples yet (samples.every_steps in the config)", style="dim"))
            return
        k = self.order[min(table.cursor_row, len(self.order) - 1)]
        s = self.samples[k]
        out = Text(f"step {k[0]:,} · ", style="bold")
        out.append(repr(s.prompt), style="cyan")
        out.append(f" · {len(self.order)} sample(s)\n", style="dim")
        out.append(s.text)
        box.update(out)

    def on_data_table_row_highlighted(self, _event: DataTable.RowHighlighted) -> None:
        self._detail()

    def action_order(self) -> None:
        self.by_prompt = not self.by_prompt
        self._fill()
