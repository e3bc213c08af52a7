"""What the app writes and says, against hostile targets, with real files and processes:
`andrea-tui export` never writes into or over anything but a regular file (a device, a FIFO, a
socket, a directory, a symbolic link are refused, with or without --force, and stay as they
were), `-` is standard output, and the dashboard's `e` never replaces a link; `andrea-tui serve`
says how to reach the address it actually listens on (IPv6 in brackets, a wildcard by the
host's name), its page works there, and its websocket refuses other sites' pages."""

from __future__ import annotations

import csv
import http.client
import io
import os
import re
import select
import signal
import socket
import stat
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from andrea_tui import export as ex
from andrea_tui.serve import how_to_reach
from engine.run.control import engine_alive
from tests.fakerun import CONFIG, write_run
from tests.test_serve import ANSI, CHROMIUM, FLAGS, wait_for

STEPS = 50


def cli(*args: str, cwd: Path | None = None, stdout: int | None = subprocess.PIPE,
        timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """`andrea-tui ARGS` as a process of its own (a hang, as in opening a FIFO, is a timeout)."""
    return subprocess.run([sys.executable, "-m", "andrea_tui.cli", *args], cwd=cwd,
                          stdout=stdout, stderr=subprocess.PIPE, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})


@pytest.fixture
def run(tmp_path: Path) -> Path:
    return write_run(tmp_path / "run", STEPS).root


def one_error_line(r: subprocess.CompletedProcess[str], *needles: str) -> str:
    err = r.stderr.strip()
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in err, err
    return err


def character_device(tmp_path: Path) -> Path:
    """A character device to export onto: as root, a node of the test's own (the null device's
    numbers, made with mknod), so that a regression could never replace the system's
    /dev/null; otherwise /dev/null itself, which only root could replace."""
    if os.geteuid() != 0:
        return Path("/dev/null")
    node = tmp_path / "null"
    os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    return node


def test_a_device_is_refused_and_stays_a_device(run: Path, tmp_path: Path) -> None:
    device = character_device(tmp_path)
    before = os.lstat(device)
    for force in (("--force",), ()):
        r = cli("export", str(run), "--csv", str(device), *force)
        one_error_line(r, f"{device}: a character device, not a regular file")
        after = os.lstat(device)
        assert stat.S_ISCHR(after.st_mode) and after.st_rdev == before.st_rdev
        assert after.st_ino == before.st_ino


def test_a_fifo_is_refused_without_opening_it(run: Path, tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for args in (("--csv", str(fifo)), ("--csv", str(fifo), "--force"),
                 ("--png", str(fifo), "--force")):
        r = cli("export", str(run), *args)  # nobody reads the FIFO: an open would hang
        one_error_line(r, f"{fifo}: a FIFO (named pipe), not a regular file")
        assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_a_socket_is_refused(run: Path, tmp_path: Path) -> None:
    path = tmp_path / "sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))
        r = cli("export", str(run), "--csv", str(path), "--force")
        one_error_line(r, f"{path}: a socket, not a regular file")
        assert stat.S_ISSOCK(os.lstat(path).st_mode)


def test_a_directory_is_refused_and_untouched(run: Path, tmp_path: Path) -> None:
    d = tmp_path / "out"
    d.mkdir()
    (d / "keep.txt").write_text("mine")
    for force in ((), ("--force",)):
        r = cli("export", str(run), "--csv", str(d), *force)
        one_error_line(r, f"{d}: a directory, not a regular file")
    assert sorted(os.listdir(d)) == ["keep.txt"] and (d / "keep.txt").read_text() == "mine"


def test_symbolic_links_are_refused_and_stay(run: Path, tmp_path: Path) -> None:
    """--force replaces regular files only: a link to one is refused (the link stays, its target
    keeps its bytes); a dangling link is not written through, nor replaced."""
    target = tmp_path / "target.csv"
    target.write_text("mine\n")
    link = tmp_path / "link.csv"
    link.symlink_to(target)
    r = cli("export", str(run), "--csv", str(link), "--force")
    one_error_line(r, f"{link}: a symbolic link (to {target})", "name the file itself")
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert target.read_text() == "mine\n"
    dangling = tmp_path / "dangling.csv"
    dangling.symlink_to(tmp_path / "nowhere.csv")
    r = cli("export", str(run), "--csv", str(dangling))
    one_error_line(r, f"{dangling}: a symbolic link")
    assert dangling.is_symlink() and not (tmp_path / "nowhere.csv").exists()


def test_force_replaces_a_regular_file_by_a_rename(run: Path, tmp_path: Path) -> None:
    """The replacement is a new file renamed over the old one (a reader holding the old one
    keeps it whole, as does a second name of it); nothing temporary stays behind."""
    out = tmp_path / "steps.csv"
    out.write_text("old\n")
    other_name = tmp_path / "hardlink.csv"
    os.link(out, other_name)
    r = cli("export", str(run), "--csv", str(out), "--force")
    assert r.returncode == 0, r.stderr
    assert out.read_text().startswith("step,loss,") and other_name.read_text() == "old\n"
    assert sorted(os.listdir(tmp_path)) == ["hardlink.csv", "run", "steps.csv"]


def test_force_keeps_the_replaced_files_mode(run: Path, tmp_path: Path) -> None:
    out = tmp_path / "private.csv"
    out.write_text("old\n")
    out.chmod(0o600)
    r = cli("export", str(run), "--csv", str(out), "--force")
    assert r.returncode == 0, r.stderr
    assert out.read_text().startswith("step,loss,") and stat.S_IMODE(out.stat().st_mode) == 0o600


def test_an_interrupted_write_leaves_no_temporary_file(tmp_path: Path, monkeypatch) -> None:
    real_fdopen = os.fdopen

    def interrupted(fd: int, *a, **k):
        f = real_fdopen(fd, *a, **k)
        f.write = lambda data: (_ for _ in ()).throw(KeyboardInterrupt())
        return f

    monkeypatch.setattr(ex.os, "fdopen", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ex.write_file(tmp_path / "plot.png", b"x" * 100)
    assert os.listdir(tmp_path) == []


def test_dash_is_standard_output(run: Path, tmp_path: Path) -> None:
    r = cli("export", str(run), "--csv", "-", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    rows = list(csv.reader(io.StringIO(r.stdout)))
    assert rows[0][:2] == ["step", "loss"] and [int(x[0]) for x in rows[1:]] == list(
        range(1, STEPS + 1))
    assert r.stderr.strip() == f"standard output: {STEPS} steps"
    assert not (tmp_path / "-").exists()
    r = cli("export", str(run), "--csv", "-", "--png", "-", cwd=tmp_path)
    one_error_line(r, "cannot both go to standard output")


def test_a_full_standard_output_is_a_run_time_failure(run: Path, tmp_path: Path) -> None:
    with open("/dev/full", "w") as full:
        r = cli("export", str(run), "--csv", "-", cwd=tmp_path, stdout=full.fileno())
    assert r.returncode == 1, r.stderr
    assert r.stderr.strip() == "error: standard output: cannot write: No space left on device"
    assert not (tmp_path / "-").exists()


def test_png_to_standard_output_only_when_it_is_not_a_terminal(run: Path,
                                                               tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    r = subprocess.run([sys.executable, "-m", "andrea_tui.cli", "export", str(run), "--png", "-",
                        "--size", "320x240"], cwd=tmp_path, capture_output=True, timeout=120,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    assert r.stdout[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", r.stdout[16:24]) == (
        320, 240)
    assert r.stderr.decode().strip() == "standard output: 320x240 PNG"
    master, slave = os.openpty()
    try:
        r2 = cli("export", str(run), "--png", "-", cwd=tmp_path, stdout=slave)
        one_error_line(r2, "--png -: standard output is a terminal")
        assert select.select([master], [], [], 0)[0] == []  # not a byte on the terminal
    finally:
        os.close(master)
        os.close(slave)
    assert not (tmp_path / "-").exists()


def test_the_dashboards_export_never_replaces_a_link(run: Path, tmp_path: Path) -> None:
    """`e` writes fresh names; a dangling link under the first one is a taken name, not a
    free one: the link stays, and nothing is written where it points."""
    name = run / f"export-step{STEPS:08d}.csv"
    name.symlink_to(tmp_path / "elsewhere.csv")
    written, _ = ex.export_into_run(run)
    assert written[0] == run / f"export-step{STEPS:08d}-2.csv"
    assert name.is_symlink() and not (tmp_path / "elsewhere.csv").exists()
    assert written[0].read_text().startswith("step,loss,")


# ---------------------------------------------------------------- serve


@pytest.mark.parametrize("host, ssh, local", [
    ("127.0.0.1", "127.0.0.1", "127.0.0.1"),
    ("127.3.2.1", "127.3.2.1", "127.0.0.1"),  # ssh -L listens on the client's 127.0.0.1
    ("::1", "[::1]", "[::1]"),
    ("[::1]", "[::1]", "[::1]"),
    ("localhost", "localhost", "localhost"),
])
def test_the_ssh_hint_names_the_address_listened_on(host: str, ssh: str, local: str) -> None:
    text = how_to_reach(Path("runs/x"), host, 8000, False)
    assert f"on http://{ssh}:8000" in text
    assert f"ssh -L 8000:{ssh}:8000 THIS_HOST, then open http://{local}:8000 there" in text
    if ssh != "127.0.0.1":
        assert "8000:127.0.0.1:8000" not in text


def test_a_wildcard_address_is_said_as_the_hosts_name() -> None:
    name = socket.gethostname()
    v4 = how_to_reach(Path("r"), "0.0.0.0", 8000, False)
    assert f"every IPv4 address of this host: http://{name}:8000" in v4
    v6 = how_to_reach(Path("r"), "::", 8000, False)
    assert f"every IPv6 address of this host: http://{name}:8000" in v6
    assert "IPv6 only" in v6  # asyncio listens on :: with IPV6_V6ONLY
    for text in (v4, v6):
        assert "http://0.0.0.0" not in text and "http://[::]" not in text
        assert "ssh -L" not in text and "anyone who reaches it can stop the run" in text
    assert "on http://10.1.2.3:8000" in how_to_reach(Path("r"), "10.1.2.3", 8000, False)
    assert "on http://[fd00::5]:8000" in how_to_reach(Path("r"), "fd00::5", 8000, False)


def ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def free_port6() -> int:
    with socket.socket(socket.AF_INET6) as s:
        s.bind(("::1", 0))
        return s.getsockname()[1]


def wait_listening6(port: int, server: subprocess.Popen) -> None:
    """Until the server accepts connections on [::1]:port (its banner comes before it listens)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert server.poll() is None, "the server ended"
        try:
            socket.create_connection(("::1", port), timeout=5).close()
            return
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"nothing listens on [::1]:{port}")


def request(port: int, path: str, headers: dict[str, str]) -> tuple[int, str]:
    conn = http.client.HTTPConnection("::1", port, timeout=30)
    try:
        conn.request("GET", path, headers=headers)
        resp = conn.getresponse()
        body = "" if resp.status == 101 else resp.read().decode("utf-8", "replace")
        return resp.status, body
    finally:
        conn.close()


def websocket_headers(port: int, origin: str | None) -> dict[str, str]:
    h = {"Host": f"[::1]:{port}", "Connection": "Upgrade", "Upgrade": "websocket",
         "Sec-WebSocket-Version": "13", "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="}
    return {**h, "Origin": origin} if origin else h


@pytest.fixture
def served_on_ipv6(run: Path) -> Iterator[tuple[int, str]]:
    pytest.importorskip("textual_serve", reason="textual-serve is not installed")
    if not ipv6_loopback():
        pytest.skip("this machine has no IPv6 loopback")
    port = free_port6()
    server = subprocess.Popen([sys.executable, "-m", "andrea_tui.cli", "serve", str(run),
                               "--host", "::1", "--port", str(port)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL)
    try:
        banner = "".join(server.stdout.readline() for _ in range(3))  # type: ignore[union-attr]
        wait_listening6(port, server)
        yield port, banner
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def test_served_on_ipv6_loopback_the_page_and_the_hint_work(served_on_ipv6) -> None:
    port, banner = served_on_ipv6
    assert f"on http://[::1]:{port}" in banner, banner
    assert f"ssh -L {port}:[::1]:{port} THIS_HOST" in banner, banner
    status, page = request(port, "/", {"Host": f"[::1]:{port}"})
    assert status == 200
    # The page's links are usable URLs of the address asked for (not http://::1:PORT).
    assert f'data-session-websocket-url="ws://[::1]:{port}/ws"' in page
    assert re.search(rf'src="http://\[::1\]:{port}/static/js/textual\.js"', page)
    # Through a forwarded port the page names the port the browser used.
    status, page = request(port, "/", {"Host": "localhost:9999"})
    assert status == 200 and 'websocket-url="ws://localhost:9999/ws"' in page


def test_the_websocket_refuses_other_sites(served_on_ipv6) -> None:
    port, _ = served_on_ipv6
    status, body = request(port, "/ws", websocket_headers(port, "http://evil.example"))
    assert status == 403 and "another origin" in body
    status, body = request(port, "/", {"Host": f"evil.example:{port}"})  # a rebound name
    assert status == 403 and "loopback" in body
    status, _ = request(port, "/ws", {**websocket_headers(port, "http://evil.example"),
                                      "Host": f"evil.example:{port}"})
    assert status == 403
    status, _ = request(port, "/ws", websocket_headers(port, f"http://[::1]:{port}"))
    assert status == 101  # the page's own origin


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install "
                    "chromium); .ci/run installs it")
def test_a_browser_gets_the_dashboard_served_on_ipv6(tmp_path: Path) -> None:
    """The page served on ::1 loads its scripts and its websocket there (links written
    http://::1:PORT would open nowhere) and shows the running engine's dashboard."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    pytest.importorskip("textual_serve", reason="textual-serve is not installed")
    if not ipv6_loopback():
        pytest.skip("this machine has no IPv6 loopback")
    from andrea_tui.launcher import launch

    run = tmp_path / "run"
    engine = launch([sys.executable, "-m", "tests.fakerun", str(run), "--rate", "10"], run)
    port = free_port6()
    server = subprocess.Popen([sys.executable, "-m", "andrea_tui.cli", "serve", str(run),
                               "--host", "::1", "--port", str(port)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL)
    frames: list[bytes | str] = []

    def screen() -> str:
        return ANSI.sub("", "".join(f.decode("utf-8", "replace") if isinstance(f, bytes) else f
                                    for f in frames))

    try:
        wait_for(lambda: engine_alive(run)[0], "the fake engine")
        server.stdout.readline()  # type: ignore[union-attr]  # the banner: serving
        wait_listening6(port, server)
        with sync_api.sync_playwright() as pw:
            browser = pw.chromium.launch_persistent_context(
                str(tmp_path / "chromium-profile"), executable_path=CHROMIUM, headless=True,
                args=FLAGS, viewport={"width": 1400, "height": 900})
            try:
                page = browser.new_page()
                local = f"[::1]:{port}"
                page.route("**/*", lambda r: r.continue_() if local in r.request.url
                           else r.abort())
                page.on("websocket", lambda ws: ws.on("framereceived", lambda f: frames.append(f)))
                page.goto(f"http://{local}/", wait_until="domcontentloaded")
                deadline = time.monotonic() + 30
                while not (CONFIG["name"] in screen() and re.search(r"step \d+", screen())):
                    assert time.monotonic() < deadline, f"no dashboard: {screen()[-2000:]!r}"
                    page.wait_for_timeout(100)  # playwright delivers the frames meanwhile
            finally:
                browser.close()
    finally:
        for proc in (server, engine):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
