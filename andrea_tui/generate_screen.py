"""`g` in the checkpoint browser: a prompt, then the checkpoint's completion as it streams.

The text comes from `andrea-sample` (engine.run.sample_cli) run as a child process: the model,
its backends and the tokenizer stay out of the app's process (the import contracts), and escape
ends the child at once. Same prompt, tokens and seed: the same text as the command line gives.
"""

from __future__ import annotations

import asyncio
import codecs
import sys
from pathlib import Path
from typing import ClassVar

from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Input, Label, Static

from andrea_tui.launcher import child_env

DEFAULT_TOKENS = 100


def sample_argv(checkpoint: Path, prompt: str, tokens: int, seed: int,
                backend: str = "auto") -> list[str]:
    """The andrea-sample command line (through this interpreter: no PATH needed)."""
    return [sys.executable, "-m", "engine.run.sample_cli", str(checkpoint), "--prompt", prompt,
            "--tokens", str(tokens), "--seed", str(seed), "--backend", backend]


def _int(text: str, default: int) -> int | None:
    text = text.strip()
    if not text:
        return default
    try:
        return int(text)
    except ValueError:
        return None


class GenerateScreen(ModalScreen[None]):
    DEFAULT_CSS = """
    GenerateScreen { align: center middle; }
    GenerateScreen #gen-body { width: 90%; height: 80%; border: thick $primary;
                               background: $surface; padding: 0 1; }
    GenerateScreen #gen-options { height: 3; }
    GenerateScreen #gen-options Input { width: 1fr; }
    GenerateScreen #gen-options Label { padding: 1 1 0 1; }
    GenerateScreen #gen-out { height: 1fr; border: round $primary 50%; }
    GenerateScreen #gen-status { height: auto; }
    """
    BINDINGS: ClassVar[list[Binding]] = [Binding("escape", "close", "close")]

    def __init__(self, checkpoint: Path, backend: str = "auto") -> None:
        super().__init__()
        self.checkpoint = Path(checkpoint)
        self.backend = backend
        self.text = ""  # what andrea-sample wrote to stdout: the prompt, then the completion
        self.prompt = ""
        self.status = ""
        self.done = False
        self._proc: asyncio.subprocess.Process | None = None

    def compose(self) -> ComposeResult:
        with Vertical(id="gen-body"):
            yield Static(f"[b]generate[/b] from {self.checkpoint} · enter: go · escape: close")
            yield Input(placeholder="prompt", id="gen-prompt")
            with Horizontal(id="gen-options"):
                yield Label("tokens")
                yield Input(str(DEFAULT_TOKENS), id="gen-tokens")
                yield Label("seed")
                yield Input("0", id="gen-seed")
            with VerticalScroll(id="gen-out"):
                yield Static("", id="gen-text")
            yield Static("", id="gen-status")

    def on_mount(self) -> None:
        self.query_one("#gen-prompt", Input).focus()

    def on_input_submitted(self, _event: Input.Submitted) -> None:
        tokens = _int(self.query_one("#gen-tokens", Input).value, DEFAULT_TOKENS)
        seed = _int(self.query_one("#gen-seed", Input).value, 0)
        if tokens is None or seed is None:
            self._status(Text("tokens and seed: whole numbers", style="bold red"))
            return
        self.prompt = self.query_one("#gen-prompt", Input).value
        self._generate(sample_argv(self.checkpoint, self.prompt, tokens, seed, self.backend))

    def _status(self, text: Text | str) -> None:
        self.status = str(text)
        self.query_one("#gen-status", Static).update(text)

    def _show_text(self) -> None:
        shown = Text()
        if self.text.startswith(self.prompt):
            shown.append(self.prompt, style="bold")
            shown.append(self.text[len(self.prompt):])
        else:
            shown.append(self.text)
        self.query_one("#gen-text", Static).update(shown)

    @work(exclusive=True, group="generate", exit_on_error=False)
    async def _generate(self, argv: list[str]) -> None:
        await self._stop_child()
        self.text, self.done = "", False
        self._show_text()
        self._status("loading the checkpoint…")
        env = {**child_env(), "PYTHONIOENCODING": "utf-8"}
        proc = self._proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env=env)
        assert proc.stdout is not None and proc.stderr is not None
        err_task = asyncio.ensure_future(proc.stderr.read())
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        while chunk := await proc.stdout.read(4096):
            self.text += decoder.decode(chunk)
            if self.status.startswith("loading"):
                self._status("generating…")
            self._show_text()
        self.text += decoder.decode(b"", final=True)
        code = await proc.wait()
        err = (await err_task).decode("utf-8", "replace").strip().splitlines()
        self._proc = None
        self._show_text()
        if code == 0:
            self._status(Text(" · ".join(ln.removeprefix("andrea-sample: ") for ln in err),
                              style="dim"))
        else:
            errors = [ln for ln in err if ln.startswith("error: ")] or err[-1:] or [
                f"andrea-sample exited with status {code}"]
            self._status(Text(errors[-1], style="bold red"))
        self.done = True

    async def _stop_child(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.returncode is None:
            proc.kill()  # our own child, by its process object
            await proc.wait()

    async def action_close(self) -> None:
        await self._stop_child()
        self.dismiss(None)
