"""The ranks' control channel: rendezvous, small collectives on the host, and a watch on peers.

Rank 0 listens; every other rank connects twice: a data connection (framed messages, answered in
rank order) and a liveness connection that never carries a byte, so that a rank that dies — kill
-9, a GPU error, a lost host — is seen at once as an end of file (or a reset) by the others, who
then stop within a bounded time with a message naming it, instead of waiting forever in a
collective.

Rendezvous: `tcp` (rank 0 at MASTER_ADDR:MASTER_PORT, as torchrun and our launcher set them) or
`file` (rank 0 publishes its address in the run directory, for a shared file system). Ranks show
each other the job's token (ANDREA_JOB_TOKEN) before anything else is said; a connection without
it is dropped. The GPU data (gradients) never goes through here: NCCL carries it
(engine.backends.cuda.nccl); this carries the NCCL id, the stop and snapshot decisions and the
per-row losses, and, for the numpy backend, the gradients themselves (`allreduce_sum`).
"""

from __future__ import annotations

import errno
import json
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from engine import env
from engine.errors import RunError, UserError
from engine.run.world import World

JOIN_POLL_S = 0.2  # a rank waiting for the others looks at its stop flag this often
STEP_TIMEOUT_S = 1800.0  # a collective waits this long for a live peer (a first step compiles)
MAX_HEADER = 1 << 16
MAX_BODY = 2 << 30


def join_timeout() -> float:
    """Seconds a rank waits for the others (ANDREA_JOIN_TIMEOUT, default 120)."""
    return env.JOIN_TIMEOUT.read()


class JoinInterrupted(Exception):
    """A stop (SIGTERM, SIGINT, SIGHUP) came while the ranks were still meeting."""


class PeerLost(RunError):
    """Another rank of the job is gone; the message names it."""


# A peer's end shows on its connection as an end of file, or, when it died with bytes unread or
# while we write, as a reset or a broken pipe: all three say "<who> ended", the words of the
# liveness watch (_watch_peers), whichever sees it first.
PEER_GONE = (errno.ECONNRESET, errno.EPIPE, errno.ECONNABORTED)


def _lost(who: str, e: OSError) -> PeerLost:
    if e.errno in PEER_GONE:
        return PeerLost(f"{who} ended (its connection was reset: the process exited or its host "
                        f"is gone)")
    return PeerLost(f"{who}: connection lost ({e.strerror or e})")


def _send(sock: socket.socket, header: dict, body: bytes = b"", *, who: str) -> None:
    h = json.dumps(header).encode()
    try:
        sock.sendall(struct.pack(">IQ", len(h), len(body)) + h + body)
    except TimeoutError:
        raise PeerLost(f"{who}: took nothing within {sock.gettimeout():.0f} s") from None
    except OSError as e:
        raise _lost(who, e) from None


def _recv_exact(sock: socket.socket, n: int, who: str) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        try:
            chunk = sock.recv(min(n - len(buf), 1 << 20))
        except TimeoutError:
            raise PeerLost(f"{who}: no answer within {sock.gettimeout():.0f} s") from None
        except OSError as e:
            raise _lost(who, e) from None
        if not chunk:
            raise PeerLost(f"{who} ended (its connection closed: the process exited or its "
                           f"host is gone)")
        buf += chunk
    return bytes(buf)


def _recv(sock: socket.socket, who: str) -> tuple[dict, bytes]:
    hlen, blen = struct.unpack(">IQ", _recv_exact(sock, 12, who))
    if hlen > MAX_HEADER or blen > MAX_BODY:
        raise PeerLost(f"{who}: not one of this job's messages (sizes {hlen}, {blen})")
    try:
        header = json.loads(_recv_exact(sock, hlen, who))
    except ValueError:
        raise PeerLost(f"{who}: not one of this job's messages") from None
    if not isinstance(header, dict):
        raise PeerLost(f"{who}: not one of this job's messages")
    return header, _recv_exact(sock, blen, who)


def _rendezvous_file(run_dir: Path, world: World) -> Path:
    return Path(run_dir) / f".rendezvous-{world.job_id or 'job'}.json"


def _forget_inherited(fd: int) -> None:
    """Close the socket `andrea-train --gpus` handed down when it is not used."""
    os.environ.pop(env.LISTEN_FD.name, None)
    try:
        os.close(fd)
    except OSError:
        pass


class Channel:
    """Rank 0 holds a connection to every rank; collectives go through it in rank order."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.data: dict[int, socket.socket] = {}  # rank 0: rank -> data socket; others: {0: ..}
        self.live: dict[int, socket.socket] = {}
        self.lost: str | None = None
        self._on_lost: list[Callable[[str], None]] = []
        self._watch: threading.Thread | None = None
        self._closing = False
        self._server: socket.socket | None = None

    # ------------------------------------------------------------ joining

    @staticmethod
    def _inherited(w: World) -> socket.socket:
        """The socket `andrea-train --gpus` bound to MASTER_PORT and handed to rank 0 (bound
        before any rank started: no other process can take the port in between)."""
        assert w.listen_fd is not None
        os.environ.pop(env.LISTEN_FD.name, None)  # its children must not take it for theirs
        try:
            os.set_inheritable(w.listen_fd, False)
            srv = socket.socket(fileno=w.listen_fd)
            port = srv.getsockname()[1]
        except OSError as e:
            raise UserError(f"environment {env.LISTEN_FD.name}: fd {w.listen_fd} is not a usable "
                            f"listening socket ({e.strerror or e})") from None
        if port != w.master_port:
            srv.close()
            raise UserError(f"environment {env.LISTEN_FD.name}: the socket listens on port {port}, not "
                            f"MASTER_PORT {w.master_port}")
        return srv

    @classmethod
    def join(cls, world: World, run_dir: Path, timeout: float | None = None,
             should_stop: Callable[[], bool] = lambda: False) -> Channel:
        """Meet the other ranks (rank 0 waits for all of them); RunError naming who is missing
        after `timeout` seconds (default: join_timeout()); JoinInterrupted when `should_stop()`
        says so meanwhile."""
        timeout = join_timeout() if timeout is None else timeout
        ch = cls(world)
        if world.main:
            ch._serve(run_dir, timeout, should_stop)
        else:
            ch._connect(run_dir, timeout, should_stop)
        ch._watch = threading.Thread(target=ch._watch_peers, name="andrea-peers", daemon=True)
        ch._watch.start()
        return ch

    def _serve(self, run_dir: Path, timeout: float, should_stop: Callable[[], bool]) -> None:
        w = self.world
        if w.listen_fd is not None and w.rendezvous == "tcp":
            srv = self._inherited(w)
        else:
            if w.listen_fd is not None:  # handed down, but the file rendezvous binds its own
                _forget_inherited(w.listen_fd)
            srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                if w.rendezvous == "file":
                    srv.bind(("0.0.0.0", 0))
                else:
                    srv.bind((w.master_addr, w.master_port))
            except OSError as e:
                srv.close()
                raise UserError(f"environment MASTER_ADDR, MASTER_PORT: rank 0 cannot listen on "
                                f"{w.master_addr}:{w.master_port} ({e.strerror or e}): give an "
                                f"address of this host and a free port") from None
        srv.listen(2 * w.size)
        self._server = srv
        if w.rendezvous == "file":
            host = socket.gethostbyname(socket.gethostname())
            path = _rendezvous_file(run_dir, w)
            tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
            tmp.write_text(json.dumps({"host": host, "port": srv.getsockname()[1]}))
            os.replace(tmp, path)
        deadline = time.monotonic() + timeout
        while len(self.data) < w.size - 1 or len(self.live) < w.size - 1:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(1, w.size)) - set(self.data))
                where = self._where()
                self.close()
                raise RunError(f"rank(s) {', '.join(map(str, missing))} did not join within "
                               f"{timeout:.0f} s (rank 0 listened at {where})")
            if should_stop():
                self.close()
                raise JoinInterrupted
            if not select.select([srv], [], [], min(left, JOIN_POLL_S))[0]:
                continue
            conn, _ = srv.accept()
            conn.settimeout(10)
            try:
                hello, _ = _recv(conn, "a rank joining")
            except PeerLost:
                conn.close()
                continue
            r = hello.get("rank")
            if (hello.get("token") != w.token or not isinstance(r, int) or not 0 < r < w.size
                    or hello.get("kind") not in ("data", "live")):
                conn.close()  # not one of ours
                continue
            conn.settimeout(STEP_TIMEOUT_S)
            (self.data if hello["kind"] == "data" else self.live)[r] = conn
        for r, s in self.data.items():
            _send(s, {"welcome": r, "size": w.size}, who=f"rank {r}")
        if w.rendezvous == "file":  # everyone is in: the address is of no use to anyone now
            _rendezvous_file(run_dir, w).unlink(missing_ok=True)

    def _where(self) -> str:
        w = self.world
        if w.rendezvous == "file" and self._server is not None:
            return f"port {self._server.getsockname()[1]} (file rendezvous)"
        return f"{w.master_addr}:{w.master_port}"

    def _connect(self, run_dir: Path, timeout: float, should_stop: Callable[[], bool]) -> None:
        w = self.world
        deadline = time.monotonic() + timeout
        while True:
            try:
                host, port = self._address(run_dir)
                socks = []
                for kind in ("data", "live"):
                    s = socket.create_connection((host, port), timeout=5)
                    socks.append(s)
                    _send(s, {"rank": w.rank, "token": w.token, "kind": kind, "pid": os.getpid()},
                          who="rank 0")
                self.data[0], self.live[0] = socks
                self.data[0].settimeout(max(1.0, deadline - time.monotonic()))
                hello, _ = _recv(self.data[0], "rank 0")
                if hello.get("welcome") != w.rank:
                    raise PeerLost("rank 0: unexpected welcome")
                self.data[0].settimeout(STEP_TIMEOUT_S)
                return
            except (OSError, PeerLost) as e:
                for s in list(self.data.values()) + list(self.live.values()):
                    s.close()
                self.data.clear()
                self.live.clear()
                if time.monotonic() >= deadline:
                    raise RunError(f"rank {w.rank} could not join within {timeout:.0f} s: no "
                                   f"answer from rank 0 at {self._target(run_dir)} ({e})") from None
                if should_stop():
                    raise JoinInterrupted from None
                time.sleep(JOIN_POLL_S)

    def _address(self, run_dir: Path) -> tuple[str, int]:
        w = self.world
        if w.rendezvous != "file":
            return w.master_addr, w.master_port
        info = json.loads(_rendezvous_file(run_dir, w).read_text())  # OSError/ValueError: retry
        return str(info["host"]), int(info["port"])

    def _target(self, run_dir: Path) -> str:
        w = self.world
        return (str(_rendezvous_file(run_dir, w)) if w.rendezvous == "file"
                else f"{w.master_addr}:{w.master_port}")

    # ------------------------------------------------------------ liveness

    def on_peer_lost(self, fn: Callable[[str], None]) -> None:
        """Call `fn(message)` (from the watch thread) when a peer is gone, e.g. to abort NCCL."""
        self._on_lost.append(fn)

    def _watch_peers(self) -> None:
        socks = {s: r for r, s in self.live.items()}
        while socks and not self._closing:
            try:
                ready, _, _ = select.select(list(socks), [], [], 0.5)
            except (OSError, ValueError):
                return
            for s in ready:
                try:
                    gone = not s.recv(1)
                except OSError:
                    gone = True
                if gone and not self._closing:
                    r = socks.pop(s)
                    self.lost = (f"rank {r} ended (pid exited or its host is gone)" if r
                                 else "rank 0 ended (the job's first rank is gone)")
                    for fn in self._on_lost:
                        fn(self.lost)

    def check(self) -> None:
        if self.lost is not None:
            raise PeerLost(self.lost)

    # ------------------------------------------------------------ collectives

    def allgather(self, payload: bytes) -> list[bytes]:
        """Every rank's payload, in rank order, on every rank."""
        self.check()
        w = self.world
        if not w.distributed:
            return [payload]
        if w.main:
            parts = [payload]
            for r in range(1, w.size):
                _, body = _recv(self.data[r], f"rank {r}")
                parts.append(body)
            lens = json.dumps([len(p) for p in parts])
            blob = b"".join(parts)
            for r in range(1, w.size):
                _send(self.data[r], {"lens": json.loads(lens)}, blob, who=f"rank {r}")
            return parts
        _send(self.data[0], {"rank": w.rank}, payload, who="rank 0")
        header, blob = _recv(self.data[0], "rank 0")
        lens = header.get("lens")
        if not isinstance(lens, list) or sum(lens) != len(blob) or len(lens) != w.size:
            raise PeerLost("rank 0: not one of this job's messages")
        out, at = [], 0
        for n in lens:
            out.append(blob[at : at + n])
            at += n
        return out

    def broadcast(self, payload: bytes) -> bytes:
        """Rank 0's payload on every rank."""
        return self.allgather(payload if self.world.main else b"")[0]

    def max_int(self, x: int) -> int:
        """The largest of every rank's `x` (the stop and snapshot requests are agreed on so)."""
        return max(int.from_bytes(p, "big", signed=True)
                   for p in self.allgather(int(x).to_bytes(8, "big", signed=True)))

    def allgather_array(self, a: np.ndarray) -> list[np.ndarray]:
        a = np.ascontiguousarray(a)
        return [np.frombuffer(p, dtype=a.dtype).reshape(a.shape)
                for p in self.allgather(a.tobytes())]

    def allreduce_sum(self, a: np.ndarray) -> np.ndarray:
        """The sum of every rank's `a`, added in rank order (the same bits on every rank)."""
        parts = self.allgather_array(a)
        out = parts[0].copy()
        for p in parts[1:]:
            out += p
        return out

    def finish(self) -> None:
        """The last collective of the job: after it, a peer that ends is no longer news."""
        self.allgather(b"")
        self._closing = True

    def close(self) -> None:
        self._closing = True
        for s in (*self.data.values(), *self.live.values()):
            try:
                s.close()
            except OSError:
                pass
        if self._server is not None:
            self._server.close()
