"""`andrea-tui serve`: loopback unless --public (and why), a port in use is one line, and a real
browser — headless Chromium (Debian's package) driven by Playwright — opens the served dashboard
of a running fake engine, sees its experiment and step, and, before any click, presses `s` (a
snapshot checkpoint appears in the run directory) and then `q` (the engine stops), through the
verified control path.
ANDREA_SCREEN_CAPTURE=DIR also keeps the browser's screenshot there."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from andrea_tui.serve import check_host, is_loopback
from engine.errors import UserError
from engine.run.control import engine_alive
from engine.runfiles import read_jsonl
from tests.fakerun import CONFIG, write_run

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ANSI = re.compile(r"\x1b\[[0-9;?<>=]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[()=>][A-Z0-9]?")


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "andrea_tui.cli", *args], capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def test_loopback_only_unless_public() -> None:
    for host in ("127.0.0.1", "127.3.2.1", "localhost", "::1", "[::1]"):
        assert is_loopback(host), host
        check_host(host, public=False)
    for host in ("0.0.0.0", "::", "10.1.2.3", "example.org"):
        assert not is_loopback(host), host
        with pytest.raises(UserError, match="pass --public"):
            check_host(host, public=False)
        check_host(host, public=True)


def test_serve_refusals_are_one_line(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", 10).root
    r = cli("serve", str(run), "--host", "0.0.0.0")
    assert r.returncode == 2 and "not a loopback address" in r.stderr
    assert "SSH" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    with socket.socket() as s:  # a port somebody else listens on
        s.bind(("127.0.0.1", 0))
        s.listen()
        r = cli("serve", str(run), "--port", str(s.getsockname()[1]))
    assert r.returncode == 2 and "cannot listen" in r.stderr and "Traceback" not in r.stderr
    r = cli("serve", str(run), "--resume")
    assert r.returncode == 2 and "go with a CONFIG" in r.stderr
    r = cli("serve", str(tmp_path / "nothing"))
    assert r.returncode == 2 and "nothing" in r.stderr


def test_the_page_focuses_its_terminal_on_load() -> None:
    from andrea_tui.serve import FOCUS_SCRIPT, with_focus_script

    page = '<html><body><div id="terminal" class="textual-terminal"></div></body></html>'
    out = with_focus_script(page)
    assert out.index(FOCUS_SCRIPT) > out.index('id="terminal"') and out.endswith("</body></html>")
    assert ".xterm-helper-textarea" in FOCUS_SCRIPT and "focus(" in FOCUS_SCRIPT
    assert with_focus_script("<html>no body</html>") == "<html>no body</html>"


BLOCK_TEXTUAL_SERVE = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "textual_serve" or name.startswith("textual_serve."):
            raise ImportError("blocked for the test")
sys.meta_path.insert(0, Block())
from andrea_tui.cli import main
main(sys.argv[1:])
"""


def test_serve_without_textual_serve_says_how_to_get_it(tmp_path: Path) -> None:
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps(CONFIG))
    r = subprocess.run([sys.executable, "-c", BLOCK_TEXTUAL_SERVE, "serve", str(cfg),
                        "--run-dir", str(tmp_path / "run")], capture_output=True, text=True,
                       timeout=60, stdin=subprocess.DEVNULL)
    assert r.returncode == 2 and "pip install 'andrea[serve]'" in r.stderr
    assert not (tmp_path / "run").exists()  # refused before any engine was started


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(cond: Callable[[], object], what: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def checkpoint_events(run: Path, reason: str) -> list[dict]:
    return [e for e in read_jsonl(run / "events.jsonl")[0]
            if e.get("event") == "checkpoint" and e.get("reason") == reason]


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install "
                    "chromium); .ci/run installs it")
def test_a_browser_steers_the_served_dashboard(tmp_path: Path) -> None:
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed "
                                   "(the test extra has it)")
    pytest.importorskip("textual_serve", reason="textual-serve is not installed (the serve and "
                        "test extras have it)")
    from andrea_tui.launcher import launch

    run = tmp_path / "run"
    engine = launch([sys.executable, "-m", "tests.fakerun", str(run), "--rate", "10"], run)
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "andrea_tui.cli", "serve", str(run),
                               "--port", str(port)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL)
    frames: list[bytes | str] = []

    def screen() -> str:
        raw = "".join(f.decode("utf-8", "replace") if isinstance(f, bytes) else f
                      for f in frames)
        return ANSI.sub("", raw)

    try:
        wait_for(lambda: engine_alive(run)[0], "the fake engine")
        banner = server.stdout.readline() + server.stdout.readline()  # type: ignore[union-attr]
        assert f"http://127.0.0.1:{port}" in banner and f"ssh -L {port}:127.0.0.1:{port}" in banner
        with sync_api.sync_playwright() as pw:
            # A fresh profile (--user-data-dir) of its own, in the test's directory.
            browser = pw.chromium.launch_persistent_context(
                str(tmp_path / "chromium-profile"), executable_path=CHROMIUM, headless=True,
                args=FLAGS, viewport={"width": 1400, "height": 900})
            try:
                page = browser.new_page()
                local = f"127.0.0.1:{port}"
                # Nothing leaves this machine: the page's web font request is dropped.
                page.route("**/*", lambda r: r.continue_() if local in r.request.url
                           else r.abort())
                page.on("websocket", lambda ws: ws.on("framereceived", lambda f: frames.append(f)))
                page.goto(f"http://{local}/", wait_until="domcontentloaded")
                deadline = time.monotonic() + 20
                while not (CONFIG["name"] in screen() and re.search(r"step \d+", screen())):
                    assert time.monotonic() < deadline, f"no dashboard: {screen()[-2000:]!r}"
                    page.wait_for_timeout(100)
                assert server.poll() is None
                # No click: the page gives the terminal the keys on load.
                page.keyboard.press("s")
                wait_for(lambda: checkpoint_events(run, "snapshot"), "a snapshot checkpoint")
                path = Path(checkpoint_events(run, "snapshot")[0]["path"])
                assert path.parent == run / "checkpoints" and path.is_dir()
                page.wait_for_timeout(300)
                shot = tmp_path / "browser.png"
                page.screenshot(path=str(shot))
                if os.environ.get("ANDREA_SCREEN_CAPTURE"):
                    keep = Path(os.environ["ANDREA_SCREEN_CAPTURE"])
                    keep.mkdir(parents=True, exist_ok=True)
                    shutil.copy(shot, keep / "browser.png")
                page.keyboard.press("q")
                wait_for(lambda: json.loads((run / "state.json").read_text())["status"]
                         == "stopped", "the stop")
                assert checkpoint_events(run, "stop")
                assert engine.wait(timeout=10) == 0
            finally:
                browser.close()
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        if engine.poll() is None:
            engine.kill()
            engine.wait(timeout=10)
