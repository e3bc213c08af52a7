"""`andrea-tui serve CONFIG|RUN_DIR [--host H] [--port P] [--public]`: the dashboard in a browser.

textual-serve (the optional `serve` extra) runs, for each browser that connects, the dashboard
attached to the run directory (`andrea-tui attach RUN_DIR`) and carries its screen and keys over
a websocket; `s` and `q` in the browser are the attached dashboard's keys, so they go through the
same verified control path (engine.run.control) as in a terminal. Given a CONFIG, the engine is
started first, detached, once (a browser that connects attaches to it, it is never started per
browser). The server listens on 127.0.0.1 unless told otherwise: whoever reaches the page can
stop the run, so an address other than a loopback one needs --public, and the way to reach it
from elsewhere is SSH port forwarding, which this command prints, naming the address listened
on. The page's own links (scripts, the websocket) are made from the address the browser asked
for, so it works through any forwarded port and on an IPv6 address. The websocket that carries
the keys is refused to a page of another origin (any web page open in the same browser could
otherwise open it and stop the run), and, on a loopback address, to a request for a name that
is not a loopback one (a DNS name rebound to 127.0.0.1). The page gives its terminal the keyboard
as it loads (FOCUS_SCRIPT): keys act before any click.
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
from urllib.parse import urlsplit

from engine.errors import UserError

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
NO_TEXTUAL_SERVE = ("serving in a browser needs textual-serve, which is not installed here: "
                    "pip install 'andrea[serve]' (or pip install textual-serve)")


def bare_host(host: str) -> str:
    """An address as the sockets take it: `[::1]` (as in a URL) is `::1`."""
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def url_host(host: str) -> str:
    """An address as a URL or `ssh -L` writes it: an IPv6 address in brackets."""
    host = bare_host(host)
    return f"[{host}]" if ":" in host else host


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(bare_host(host))
    except ValueError:
        return None


def is_loopback(host: str) -> bool:
    """True for `localhost` and the loopback addresses (127.0.0.0/8, ::1)."""
    if host.lower() == "localhost":
        return True
    ip = _ip(host)
    return ip is not None and ip.is_loopback


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
    host = bare_host(host)
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
    """What `serve` prints at start: where the dashboard is, and how to reach it from elsewhere,
    naming the address actually listened on."""
    ip = _ip(host)
    head = f"andrea-tui serve: the dashboard of {run_dir}"
    if is_loopback(host):
        # `ssh -L` listens on the client's loopback; open it by the same family's address.
        local = "localhost" if ip is None else "[::1]" if ip.version == 6 else "127.0.0.1"
        lines = [f"{head} on http://{url_host(host)}:{port}",
                 f"  from another machine: ssh -L {port}:{url_host(host)}:{port} THIS_HOST, "
                 f"then open http://{local}:{port} there"]
    elif ip is not None and ip.is_unspecified:
        family = f"IPv{ip.version}"
        lines = [f"{head} on port {port} of every {family} address of this host: "
                 f"http://{url_host(socket.gethostname())}:{port}, or this host's {family} "
                 f"address in place of its name"]
        if ip.version == 6:
            lines.append("  IPv6 only (--host 0.0.0.0 listens on IPv4)")
    else:
        lines = [f"{head} on http://{url_host(host)}:{port}"]
    if not is_loopback(host):
        lines.append("  listening on a non-loopback address (--public): anyone who reaches it "
                     "can stop the run")
    lines.append("  Ctrl+C stops serving; the engine goes on"
                 + (f" (andrea-tui attach {run_dir})" if engine_started else ""))
    return "\n".join(lines)


def page_url(scheme: str, host_header: str) -> str:
    """The base of the page's links: the address the browser asked for (its Host header), so
    that they work through a forwarded port and on an IPv6 address."""
    return f"{scheme}://{host_header}"


def origin_allowed(origin: str | None, host_header: str) -> bool:
    """A websocket may be opened by the served page itself (its Origin is the address asked
    for) or by a client that is no web page (no Origin); not by a page of another site."""
    if origin is None:
        return True
    try:
        netloc = urlsplit(origin).netloc
    except ValueError:
        return False
    return bool(netloc) and netloc.lower() == host_header.lower()


def host_allowed(host_header: str, loopback_only: bool) -> bool:
    """On a loopback address, only a request for a loopback name or address is served (a DNS
    name rebound to 127.0.0.1 by another site is not)."""
    if not loopback_only:
        return True
    try:
        name = urlsplit(f"//{host_header}").hostname
    except ValueError:
        return False
    return name is not None and is_loopback(name)


# The page's terminal takes the keys from the start: textual-serve's page leaves the focus on
# the document until a click, so keys pressed before one went nowhere. xterm.js reads keys from
# its hidden textarea, made when the terminal opens; focus it as soon as it exists (and again
# whenever the window comes back into focus while nothing else on the page holds the focus).
FOCUS_SCRIPT = """<script>
(function () {
  function focusTerminal() {
    var keys = document.querySelector("#terminal .xterm-helper-textarea");
    var held = document.activeElement;
    if (keys && held !== keys && (held === null || held === document.body)) {
      keys.focus({preventScroll: true});
    }
    return keys !== null && document.activeElement === keys;
  }
  window.addEventListener("load", function () {
    var tries = 0;
    var timer = setInterval(function () {
      if (focusTerminal() || ++tries > 600) { clearInterval(timer); }
    }, 50);
  });
  window.addEventListener("focus", focusTerminal);
  document.addEventListener("visibilitychange", focusTerminal);
})();
</script>
"""


def with_focus_script(page: str) -> str:
    """The served page with FOCUS_SCRIPT before its `</body>` (the page as it is when it has
    none)."""
    at = page.rfind("</body>")
    return page if at < 0 else page[:at] + FOCUS_SCRIPT + page[at:]


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
        """textual-serve's server, saying how to reach it instead of its logo, with the page's
        links made from the address asked for, the checks of host_allowed and origin_allowed,
        and reaping the engine it started (so the engine's exit leaves no zombie behind)."""

        def __init__(self, command: str, banner: str, proc: subprocess.Popen | None,
                     **kw: Any) -> None:
            super().__init__(command, **kw)
            self.banner = banner
            self.proc = proc
            self.loopback_only = is_loopback(kw["host"])

        def _check(self, request: Any, websocket: bool) -> None:
            from aiohttp import web

            if not host_allowed(request.host, self.loopback_only):
                raise web.HTTPForbidden(text=f"{request.host}: this dashboard is served on a "
                                        "loopback address: open it as localhost or 127.0.0.1")
            if websocket and not origin_allowed(request.headers.get("Origin"), request.host):
                raise web.HTTPForbidden(text="a page of another origin may not steer the run")

        async def handle_index(self, request: Any) -> Any:
            self._check(request, websocket=False)
            # textual-serve builds the links from public_url as it renders, before any await.
            self.public_url = page_url(request.scheme, request.host)
            response = await super().handle_index(request)
            response.text = with_focus_script(response.text)
            return response

        async def handle_websocket(self, request: Any) -> Any:
            self._check(request, websocket=True)
            return await super().handle_websocket(request)

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
    host = bare_host(host)
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
