"""Data parallelism on the CPU: the launcher, the launchers' environments, the rendezvous, rank 0
owning the run directory, signals reaching every rank, a rank that dies — real processes, the
numpy backend and the host stand-in for NCCL (engine.run.ddp.HostReducer)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.errors import UserError
from engine.run.checkpoint import verify_checkpoint
from engine.run.world import World, world_from_env
from tests.conftest import (
    ROOT,
    loss_records,
    micro_config_dict,
    run_engine,
    start_engine,
    wait_for_step,
)

KEYS = ("step", "loss", "grad_norm", "clip_scale", "lr", "tokens", "phase", "weights", "src_loss")


def trajectory(run: Path) -> list[tuple]:
    return [tuple(json.dumps(getattr(r, k), sort_keys=True) for k in KEYS)
            for r in loss_records(run)]


def ckpt(run: Path, step: int) -> bytes:
    return (run / "checkpoints" / f"step_{step:08d}" / "model.ckpt").read_bytes()


def gpus(cfg: Path, run: Path, n: int, *extra: str, backend: str = "numpy",
         **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "engine.run.cli", str(cfg), "--run-dir",
                             str(run), "--backend", backend, "--gpus", str(n), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}, **kw)


# ---------------------------------------------------------------- environments


def test_world_from_the_launchers_environments() -> None:
    assert world_from_env({}) == World()
    w = world_from_env({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                        "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.7",
                        "MASTER_PORT": "2345", "TORCHELASTIC_RUN_ID": "j1"})
    assert (w.rank, w.size, w.local_rank, w.local_size, w.master_addr, w.master_port,
            w.launcher, w.job_id) == (1, 4, 1, 2, "10.0.0.7", 2345, "torchrun", "j1")
    s = world_from_env({"SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
                        "SLURM_NTASKS_PER_NODE": "4(x2)", "SLURM_JOB_ID": "77",
                        "MASTER_ADDR": "n1"})
    assert (s.rank, s.size, s.local_rank, s.local_size, s.launcher, s.job_id) == (
        3, 8, 1, 4, "slurm", "77")
    for env, says in (({"RANK": "2", "WORLD_SIZE": "2"}, "RANK: expected an integer in"),
                      ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK: expected an integer"),
                      ({"RANK": "0"}, "WORLD_SIZE is missing"),
                      ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "99999"},
                       "MASTER_PORT"),
                      ({"RANK": "0", "WORLD_SIZE": "2", "ANDREA_RENDEZVOUS": "dns"},
                       "ANDREA_RENDEZVOUS")):
        with pytest.raises(UserError, match=says):
            world_from_env(env)


CHANNEL = r"""
import json, sys, numpy as np
from pathlib import Path
from engine.run.comm import Channel
from engine.run.world import world_from_env
w = world_from_env()
ch = Channel.join(w, Path(sys.argv[1]), timeout=float(sys.argv[2]))
parts = ch.allgather(f"r{w.rank}".encode())
s = ch.allreduce_sum(np.arange(4, dtype=np.float32) + w.rank)
m = ch.max_int(10 * w.rank)
b = ch.broadcast(b"id-from-0" if w.main else b"")
ch.finish(); ch.close()
print(json.dumps({"parts": [p.decode() for p in parts], "sum": s.tolist(), "max": m,
                  "b": b.decode()}))
"""


def ranks(n: int, tmp: Path, extra_env: dict[str, str], timeout: float = 30,
          only: list[int] | None = None, listen: socket.socket | None = None
          ) -> list[subprocess.Popen]:
    """Ranks of the CHANNEL script, torchrun style. listen: rank 0's bound socket, handed down
    as `andrea-train --gpus` does (ANDREA_LISTEN_FD), its port MASTER_PORT."""
    from engine.run.launch import free_port

    port = listen.getsockname()[1] if listen is not None else free_port()
    out = []
    for r in only if only is not None else range(n):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get(
               "PYTHONPATH", "")]), "RANK": str(r), "WORLD_SIZE": str(n),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "ANDREA_JOB_TOKEN": "t0k", "TORCHELASTIC_RUN_ID": "job", **extra_env}
        fds: tuple[int, ...] = ()
        if listen is not None and r == 0:
            env["ANDREA_LISTEN_FD"] = str(listen.fileno())
            fds = (listen.fileno(),)
        out.append(subprocess.Popen([sys.executable, "-c", CHANNEL, str(tmp), str(timeout)],
                                    env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, pass_fds=fds))
    return out


@pytest.mark.parametrize("rendezvous", ["tcp", "file"])
def test_rendezvous_and_collectives(tmp_path: Path, rendezvous: str) -> None:
    procs = ranks(3, tmp_path, {"ANDREA_RENDEZVOUS": rendezvous})
    got = []
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        got.append(json.loads(out.strip().splitlines()[-1]))
    for g in got:  # the same answers, in rank order, on every rank
        assert g == {"parts": ["r0", "r1", "r2"], "sum": [3.0, 6.0, 9.0, 12.0], "max": 20,
                     "b": "id-from-0"}


def test_a_rank_that_cannot_join_fails_naming_who_is_missing(tmp_path: Path) -> None:
    [p0] = ranks(3, tmp_path, {}, timeout=2, only=[0])
    _, err = p0.communicate(timeout=60)
    assert p0.returncode != 0 and "rank(s) 1, 2 did not join within 2 s" in err, err
    [p1] = ranks(2, tmp_path, {}, timeout=2, only=[1])
    _, err = p1.communicate(timeout=60)
    assert p1.returncode != 0 and "rank 1 could not join within 2 s" in err, err


def test_the_launcher_holds_rank_0s_port_from_its_choice_to_the_rendezvous(tmp_path: Path) -> None:
    """`--gpus` binds rank 0's socket before any rank starts and hands it down: another process
    cannot take the port in between (a port number chosen here and bound later could be), and
    rank 0 meets the others on the very socket it was given."""
    import errno

    from engine.run.launch import listening_socket

    srv = listening_socket()
    with socket.socket() as other, pytest.raises(OSError) as e:
        other.bind(("127.0.0.1", srv.getsockname()[1]))
    assert e.value.errno == errno.EADDRINUSE
    procs = ranks(2, tmp_path, {}, listen=srv)
    srv.close()  # as the launcher does: rank 0 holds its own copy
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        assert json.loads(out.strip().splitlines()[-1])["parts"] == ["r0", "r1"]


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    srv = socket.create_server(("127.0.0.1", 0))
    a = socket.create_connection(srv.getsockname(), timeout=5)
    b, _ = srv.accept()
    srv.close()
    return a, b


def test_a_peer_that_dies_is_named_alike_however_its_socket_says_so() -> None:
    """A rank killed with bytes unread resets its connection (ECONNRESET on a read, EPIPE on a
    write) instead of closing it: every way says "rank 1 ended", the liveness watch's words, so
    the run's error names the rank whichever notices first (seen: a kill -9 whose events held a
    reset and no "rank 1 ended")."""
    from engine.run.comm import PeerLost, _recv_exact, _send

    ours, theirs = _tcp_pair()
    _send(ours, {"rank": 0}, b"x" * 1000, who="rank 1")  # left unread by the peer
    time.sleep(0.05)
    theirs.close()  # with bytes unread: the kernel answers with a reset
    with pytest.raises(PeerLost, match=r"^rank 1 ended \(its connection was reset"):
        for _ in range(100):  # the first writes may still be taken into our buffer
            _send(ours, {"rank": 0}, b"y" * 65536, who="rank 1")
            time.sleep(0.01)
    ours.close()

    ours, theirs = _tcp_pair()
    theirs.sendall(b"z" * 10)
    _send(ours, {"rank": 0}, b"x" * 1000, who="rank 1")
    time.sleep(0.05)
    theirs.close()  # our bytes unread: a reset, seen by our next read
    time.sleep(0.05)
    ours.recv(10)
    with pytest.raises(PeerLost, match=r"^rank 1 ended \(its connection (was reset|closed)"):
        _recv_exact(ours, 12, "rank 1")
    ours.close()


def test_a_handed_down_socket_on_another_port_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.errors import UserError
    from engine.run.comm import Channel
    from engine.run.launch import listening_socket
    from engine.run.world import World

    srv = listening_socket()
    port = srv.getsockname()[1]
    w = World(rank=0, size=2, master_port=port + 1, listen_fd=srv.detach())  # rank 0 owns it
    monkeypatch.setenv("ANDREA_LISTEN_FD", str(w.listen_fd))
    with pytest.raises(UserError, match=f"listens on port {port}, not MASTER_PORT {port + 1}"):
        Channel._inherited(w)
    assert "ANDREA_LISTEN_FD" not in os.environ  # rank 0's children must not take it


@pytest.mark.parametrize("rank", [0, 1])
def test_a_stop_while_the_ranks_meet_ends_at_once(tmp_path: Path, write_config, rank: int) -> None:
    """A rank waiting for the others (rank 0 listening, or rank 1 knocking) hears SIGTERM and
    ends as a stop within a second or so, not after the join timeout."""
    from engine.run.launch import free_port

    cfg = write_config(micro_config_dict(max_steps=5))
    run = tmp_path / "run"
    env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "ANDREA_JOIN_TIMEOUT": "120"}
    p = start_engine(cfg, run, "--backend", "numpy", env=env)
    time.sleep(3)  # past the quick refusals, waiting for the other rank
    assert p.poll() is None
    t0 = time.monotonic()
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=60)
    # at once, not after the 120 s join timeout (the bound leaves room for a loaded machine)
    assert p.returncode == 0 and time.monotonic() - t0 < 30, out
    assert "during start-up; nothing was trained" in out or rank != 0, out


def test_bad_rendezvous_settings_are_bad_input(tmp_path: Path, write_config) -> None:
    from engine.run.launch import free_port

    cfg = write_config(micro_config_dict(max_steps=5))
    base = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port())}
    for extra, says in (({"ANDREA_JOIN_TIMEOUT": "abc"}, "ANDREA_JOIN_TIMEOUT: expected"),
                        ({"MASTER_ADDR": "no-such-host.invalid"}, "MASTER_ADDR, MASTER_PORT")):
        r = run_engine(cfg, tmp_path / "run", "--backend", "numpy", env={**base, **extra},
                       timeout=60)
        assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert not (tmp_path / "run").exists()  # refused: nothing left behind


# ---------------------------------------------------------------- training


@pytest.fixture
def cfgs(write_config) -> tuple[Path, Path]:
    one = write_config(micro_config_dict(max_steps=12), "one.json")
    two = write_config(micro_config_dict(max_steps=12, grad_accum=2), "accum2.json")
    return one, two


def test_two_ranks_equal_one_rank_with_two_micro_batches(tmp_path: Path, cfgs) -> None:
    two_ranks_equal_one_rank_with_two_micro_batches(tmp_path, cfgs, "numpy")


def two_ranks_equal_one_rank_with_two_micro_batches(tmp_path: Path, cfgs, backend: str) -> None:
    one, accum2 = cfgs
    ref = tmp_path / "accum2"
    r = run_engine(accum2, ref, "--backend", backend)
    assert r.returncode == 0, r.stdout + r.stderr
    p = gpus(one, tmp_path / "ddp", 2, backend=backend)
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0, out
    assert trajectory(tmp_path / "ddp") == trajectory(ref)
    assert ckpt(tmp_path / "ddp", 12) == ckpt(ref, 12)
    info = json.loads((tmp_path / "ddp" / "engine.json").read_text())
    assert info["pid"] == p.pid and info["world_size"] == 2 and info["launcher"] == "andrea"
    assert [r["rank"] for r in info["ranks"]] == [0, 1]
    rec = loss_records(tmp_path / "ddp")[-1]
    assert len(rec.rank_ms) == 2 and rec.tokens == 12 * 2 * 4 * 32


def test_signals_reach_every_rank_and_resume_is_bit_exact(tmp_path: Path, write_config) -> None:
    signals_reach_every_rank_and_resume_is_bit_exact(tmp_path, write_config, "numpy")


def signals_reach_every_rank_and_resume_is_bit_exact(tmp_path: Path, write_config,
                                                     backend: str) -> None:
    cfg = write_config(micro_config_dict(max_steps=30))
    straight = tmp_path / "straight"
    p = gpus(cfg, straight, 2, backend=backend)
    assert p.wait(timeout=300) == 0
    run = tmp_path / "run"
    p = gpus(cfg, run, 2, backend=backend)
    wait_for_step(run, 4, p)
    from engine.run.control import signal_engine

    signal_engine(run, signal.SIGUSR1)  # to the launcher, verified: it passes it on
    wait_for_step(run, 12, p)
    signal_engine(run, signal.SIGTERM)
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0, out
    state = json.loads((run / "state.json").read_text())
    assert state["status"] == "stopped" and state["last_checkpoint"]["reason"] == "stop"
    events = [json.loads(ln) for ln in (run / "events.jsonl").read_text().splitlines() if ln]
    reasons = sorted(e.get("reason", "") for e in events if e["event"] == "checkpoint")
    usr1 = [e for e in events if e["event"] == "signal" and e.get("signal") == "SIGUSR1"]
    assert usr1, "SIGUSR1 never reached the job"
    # a snapshot, or (on a fast GPU the periodic checkpoint may still be being written when it
    # arrives) the snapshot folded into the stop checkpoint, as documented
    assert "stop" in reasons and ("snapshot" in reasons
                                  or any(e.get("action") == "coalesced" for e in usr1)), events
    p = gpus(cfg, run, 2, "--resume", backend=backend)
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0, out
    assert trajectory(run) == trajectory(straight) and ckpt(run, 30) == ckpt(straight, 30)


@pytest.mark.parametrize("rank", [1, 0])
def test_kill_9_of_one_rank_fails_the_job_in_bounded_time(tmp_path: Path, write_config,
                                                          rank: int) -> None:
    kill_9_of_one_rank_fails_the_job_in_bounded_time(tmp_path, write_config, "numpy", rank)


def kill_9_of_one_rank_fails_the_job_in_bounded_time(tmp_path: Path, write_config,
                                                     backend: str, rank: int = 1) -> None:
    cfg = write_config(micro_config_dict(max_steps=100000))
    run = tmp_path / "run"
    p = gpus(cfg, run, 2, backend=backend)
    wait_for_step(run, 12, p)  # past the periodic checkpoint at 10, once it is written
    deadline = time.monotonic() + 120
    while json.loads((run / "state.json").read_text()).get("last_checkpoint") is None:
        assert time.monotonic() < deadline and p.poll() is None, "no checkpoint was written"
        time.sleep(0.05)
    info = json.loads((run / "engine.json").read_text())
    t0 = time.monotonic()
    os.kill(info["ranks"][rank]["pid"], signal.SIGKILL)
    out, _ = p.communicate(timeout=120)
    took = time.monotonic() - t0
    assert p.returncode == 1 and took < 40, (took, out)
    assert f"rank {rank} ended" in out
    state = json.loads((run / "state.json").read_text())
    assert state["status"] == "failed"
    assert f"rank {rank} ended" in state["error"], state  # why, and where a resume goes on
    assert "newest valid checkpoint" in state["error"], state
    events = (run / "events.jsonl").read_text()
    assert f"rank {rank} ended" in events
    verify_checkpoint(Path(state["last_checkpoint"]["path"]))
    p = gpus(cfg, run, 2, "--resume", "--max-steps", "14", backend=backend)
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0, out
    assert loss_records(run)[-1].step == 14


def test_resume_at_another_world_size_says_so(tmp_path: Path, write_config) -> None:
    cfg = write_config(micro_config_dict(max_steps=12))
    run = tmp_path / "run"
    p = gpus(cfg, run, 2, "--max-steps", "10")
    assert p.wait(timeout=300) == 0
    r = run_engine(cfg, run, "--resume")
    assert r.returncode == 0, r.stderr
    assert "was written by 2 rank(s), this job has 1" in (run / "engine.log").read_text()
    resume = [json.loads(ln) for ln in (run / "events.jsonl").read_text().splitlines()
              if '"resume"' in ln][-1]
    assert resume["world_size_was"] == 2


def test_torchrun_style_ranks_with_the_file_rendezvous(tmp_path: Path, cfgs) -> None:
    torchrun_style_ranks_with_the_file_rendezvous(tmp_path, cfgs, "numpy")


def torchrun_style_ranks_with_the_file_rendezvous(tmp_path: Path, cfgs, backend: str) -> None:
    one, accum2 = cfgs
    ref = tmp_path / "ref"
    assert run_engine(accum2, ref, "--backend", backend).returncode == 0
    run = tmp_path / "run"
    procs = []
    for r in range(2):  # as torchrun starts them: no launcher of ours, rank 0 takes the lock
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), "RANK": str(r), "WORLD_SIZE": "2",
               "LOCAL_RANK": str(r), "ANDREA_RENDEZVOUS": "file", "TORCHELASTIC_RUN_ID": "t1"}
        procs.append(subprocess.Popen([sys.executable, "-m", "engine.run.cli", str(one),
                                       "--run-dir", str(run), "--backend", backend], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out
    assert trajectory(run) == trajectory(ref) and ckpt(run, 12) == ckpt(ref, 12)
    info = json.loads((run / "engine.json").read_text())
    assert info["launcher"] == "torchrun" and info["pid"] == procs[0].pid


def test_bad_gpus_values_are_refused(tmp_path: Path, cfgs) -> None:
    one, _ = cfgs
    for extra, env, says in ((("--gpus", "0"), {}, "--gpus: must be in 1..256"),
                             (("--gpus", "100000"), {}, "--gpus: must be in 1..256"),
                             (("--gpus", "2"), {"WORLD_SIZE": "2", "RANK": "0"},
                              "already one rank")):
        r = subprocess.run([sys.executable, "-m", "engine.run.cli", str(one), "--run-dir",
                            str(tmp_path / "r"), "--backend", "numpy", *extra],
                           capture_output=True, text=True, timeout=60,
                           env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **env})
        assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_the_dashboard_shows_each_rank(tmp_path: Path) -> None:
    from andrea_tui import panels
    from andrea_tui.runstate import RunState
    from engine import records as rec
    from tests.fakerun import loss_record

    st = RunState()
    st.add_events([rec.ReadyEvent(t=1.0, backend="cuda", device="H200", tokens_per_step=16384,
                                  world_size=2).to_json()])
    st.set_files(engine=rec.EngineInfo(pid=9, start_time=1, boot_id="b", world_size=2,
                                       ranks=[rec.RankInfo(0, 10, "h", "cuda:0"),
                                              rec.RankInfo(1, 11, "h", "cuda:1")]).to_json())
    st.add_loss([{**loss_record(5, 2e9), "rank_ms": [10.0, 20.0]}])
    text = panels.training(st).plain
    assert "rank 0   cuda:0    819k tok/s   10.0 ms" in text, text  # fixed widths
    assert "rank 1   cuda:1    410k tok/s   20.0 ms behind" in text, text
    assert "×2" in panels.header(st, 2e9).plain
    st.add_events([rec.ErrorEvent(t=2.0, message="rank 1 ended (killed by signal 9)").to_json()])
    assert "20.0 ms ended" in panels.training(st).plain


def test_ranks_started_with_other_cuda_settings_are_refused() -> None:
    """Ranks that would make other NCCL calls (the all-reduce inside the step on one, after it
    on another) would pair all-reduces of other sizes and hang: refused, naming what differs."""
    from engine.errors import UserError
    from engine.run.ddp import check_same_collectives, collective_settings

    class Reducer:
        in_step = True

    class Backend:
        use_graphs = True

        def __init__(self, attention: str) -> None:
            self.resolved = {"attention": attention, "fusions": True}

    same = collective_settings(Reducer(), Backend("cudnn"))
    check_same_collectives([same, dict(same)])
    other = {**same, "gpu.ddp_overlap": False}
    with pytest.raises(UserError) as e:
        check_same_collectives([same, same, other])
    assert "gpu.ddp_overlap on rank 0 on, on rank 2 off" in str(e.value)
    assert "same environment" in str(e.value)
    other = collective_settings(Reducer(), Backend("classic"))  # a rank without cuDNN
    with pytest.raises(UserError, match=r"gpu\.attention on rank 0 cudnn, on rank 1 classic"):
        check_same_collectives([same, other])


@pytest.mark.parametrize("due", ["checkpoint", "sample", "eval"])
def test_a_stop_while_rank_0_has_work_due_every_step(due: str, tmp_path: Path,
                                                     write_config) -> None:
    """Rank 0 alone writes checkpoints, text samples and validation, yet every rank must decide
    alike whether to queue the next step behind the running one (engine.run.loop
    `_may_queue_next`): a rank that queued a step the others did not waited in its all-reduce
    while they stopped (numpy: a crash, CUDA: a hang). With that work due at every step, a
    SIGTERM ends the job cleanly, and the run resumes to the end."""
    c = micro_config_dict(max_steps=400)
    if due == "checkpoint":
        c["checkpoint"].update(every=1, keep=2)
    elif due == "sample":
        c["samples"].update(every_steps=1)
    else:
        c["eval"] = {"every_steps": 1, "batches": 1}
    cfg = write_config(c)
    run = tmp_path / "run"
    p = gpus(cfg, run, 2)
    wait_for_step(run, 5, p)
    from engine.run.control import signal_engine

    signal_engine(run, signal.SIGTERM)
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 0, out[-3000:]
    assert json.loads((run / "state.json").read_text())["status"] == "stopped"


def test_precision_reaches_every_rank(tmp_path: Path, write_config) -> None:
    """`--gpus N --precision X`: the ranks train in X; fp8, whose delayed scales follow each
    rank's own batches, is refused across ranks: exit 2, one line, no run directory."""
    cfg = write_config(micro_config_dict(max_steps=3, precision="fp32"))
    p = gpus(cfg, tmp_path / "run", 2, "--precision", "bf16")
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0, out
    ready = [json.loads(x) for x in (tmp_path / "run" / "events.jsonl").read_text().splitlines()
             if '"ready"' in x]
    assert ready and all(r["precision"] == "bf16" for r in ready)
    p = gpus(cfg, tmp_path / "run8", 2, "--precision", "fp8")
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 2 and "Traceback" not in out, out
    assert "train.precision fp8 with data parallelism (2 ranks)" in out, out
    assert not (tmp_path / "run8" / "loss.jsonl").exists()


def test_numpy_ranks_share_the_hosts_cores_among_their_blas_threads(monkeypatch) -> None:
    """`--gpus N` on the numpy backend: each rank's OpenBLAS gets cores // N threads (at least
    one), unless the user set OPENBLAS_NUM_THREADS; GPU ranks are left as they are."""
    from engine.env import usable_cores
    from engine.run.launch import rank_env

    cores = usable_cores()
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    for n in (1, 2, 64):
        assert rank_env(0, n, 1, "t", "j", cuda=False)["OPENBLAS_NUM_THREADS"] == \
            str(max(1, cores // n))
    assert "OPENBLAS_NUM_THREADS" not in rank_env(0, 2, 1, "t", "j", cuda=True)
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "3")
    assert rank_env(1, 2, 1, "t", "j", cuda=False)["OPENBLAS_NUM_THREADS"] == "3"
