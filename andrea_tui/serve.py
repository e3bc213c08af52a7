"""`andrea-tui serve CONFIG|RUN_DIR [--host H] [--port P] [--public]`: the dashboard in a browser.

textual-serve (the optional `serve` extra) runs, for each browser that connects, the dashboard
attached to the run directory (`andrea-tui attach RUN_DIR`) and carries its screen and keys over
a websocket; `s` and `q` in the browser are the attached dashboard's keys, so they go through the
same verified control path (engine.run.control) as in a terminal. Given a CONFIG, the engine is
started first, detached, once (a browser that connects attaches to it, it is never started per
browser). The server listens on 127.0.0.1 unless told otherwise: whoever reaches the page can
stop the run, so an address other than a loopback one needs --public, and the way to reach it
from elsewhere is SSH port forwarding, which this command prints.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from engine.errors import UserError

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
NO_TEXTUAL_SERVE = ("serving in a browser needs textual-serve, which is not installed here: "
                    "pip install 'andrea[serve]' (or pip install textual-serve)")


def is_loopback(host: str) -> bool:
    """True for `localhost` and the loopback addresses (127.0.0.0/8, ::1)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_host(host: str, public: bool) -> None:
    """A non-loopback address only with --public, and the reason said."""
    if not is_loopback(host) and not public:
        raise UserError(
            f"--host {host}: not a loopback address; the served dashboard has no login and its "
            "keys stop and snapshot the run, so anyone who reaches the port could too. Keep the "
            f"default ({DEFAULT_HOST}) and forward the port over SSH, or pass --public to "
            "serve on this address anyway")


def check_port(host: str, port: int) -> None:
    """The port is free on `host` (one clear line when it is not)."""
    if not 1 <= port <= 65535:
        raise UserError(f"--port: expected 1..65535, got {port}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise UserError(f"--host {host}: cannot resolve it ({e.strerror})") from None
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            raise UserError(f"--port {port}: cannot listen on {host}:{port} "
                            f"({e.strerror or e}); choose another --port") from None


def attach_command(run_dir: Path) -> str:
    """The shell command textual-serve runs for each browser: the attached dashboard."""
    return shlex.join([sys.executable, "-m", "andrea_tui.cli", "attach",
                       str(Path(run_dir).resolve())])


def how_to_reach(run_dir: Path, host: str, port: int, engine_started: bool) -> str:
    url_host = f"[{host}]" if ":" in host else host
    lines = [f"andrea-tui serve: the dashboard of {run_dir} on http://{url_host}:{port}"]
    if is_loopback(host):
        lines.append(f"  from another machine: ssh -L {port}:127.0.0.1:{port} THIS_HOST, "
                     f"then open http://127.0.0.1:{port} there")
    else:
        lines.append("  listening on a non-loopback address (--public): anyone who reaches it "
                     "can stop the run")
    lines.append("  Ctrl+C stops serving; the engine goes on"
                 + (f" (andrea-tui attach {run_dir})" if engine_started else ""))
    return "\n".join(lines)


def require_textual_serve() -> None:
    """UserError saying how to install textual-serve when it is missing."""
    try:
        import textual_serve.server  # noqa: F401
    except ImportError:
        raise UserError(NO_TEXTUAL_SERVE) from None


def _server_class() -> Any:
    require_textual_serve()
    from textual_serve.server import Server

    class AndreaServer(Server):
        """textual-serve's server, saying how to reach it instead of its logo, and reaping the
        engine it started (so the engine's exit leaves no zombie behind)."""

        def __init__(self, command: str, banner: str, proc: subprocess.Popen | None,
                     **kw: Any) -> None:
            super().__init__(command, **kw)
            self.banner = banner
            self.proc = proc

        async def on_startup(self, app: Any) -> None:
            print(self.banner, flush=True)
            if self.proc is not None:
                app["andrea_reaper"] = asyncio.ensure_future(self._reap())

        async def _reap(self) -> None:
            proc = self.proc
            while proc is not None and proc.poll() is None:
                await asyncio.sleep(1.0)
            if proc is not None:
                print(f"andrea-tui serve: the engine exited with status {proc.returncode}",
                      flush=True)

    return AndreaServer


def serve(run_dir: Path, host: str, port: int, public: bool,
          proc: subprocess.Popen | None = None) -> int:
    """Serve the attached dashboard of `run_dir` until Ctrl+C (or SIGTERM)."""
    check_host(host, public)
    server_cls = _server_class()
    check_port(host, port)
    from andrea_tui.launcher import child_env

    # textual-serve starts each browser's app with this process's environment.
    os.environ["PYTHONPATH"] = child_env()["PYTHONPATH"]
    banner = how_to_reach(run_dir, host, port, proc is not None)
    server = server_cls(attach_command(run_dir), banner, proc, host=host, port=port,
                        title=f"ANDREA · {Path(run_dir).name}")
    server.initialize_logging = lambda: None  # its rich log would repeat every request
    try:
        server.serve()
    except OSError as e:  # lost the port between the check and the bind
        raise UserError(f"--port {port}: cannot listen on {host}:{port} "
                        f"({e.strerror or e})") from None
    return 0
