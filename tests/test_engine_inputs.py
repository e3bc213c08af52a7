"""What the engine reads and allocates: a model the host cannot hold is refused before anything
is allocated, and a stop during the trainer's build ends it; FIFOs, devices and pipes given
where files are expected never hang a command; undecodable prompts and read-only run
directories are one line, not a traceback; thousands of bogus `step_*` entries neither flood
a resume's log nor keep the checkpoint browser from showing its rows."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine.run.checkpoint_write import write_checkpoint
from tests.conftest import ROOT, engine_cmd, micro_config_dict, run_engine

TABLE = [{"name": "wte", "shape": [4, 4], "offset": 0}]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def one_line(r: subprocess.CompletedProcess[str]) -> str:
    """The single `error: ...` line a refusal prints (no traceback)."""
    lines = r.stderr.strip().splitlines()
    assert "Traceback" not in r.stderr + r.stdout, r.stderr
    assert len(lines) >= 1 and lines[-1].startswith("error: "), r.stderr
    return lines[-1]


def files_of(run: Path) -> dict[str, bytes]:
    """Every file under a directory and its bytes (FIFOs by name only)."""
    return {str(p.relative_to(run)): (p.read_bytes() if p.is_file() else b"<not a file>")
            for p in sorted(run.rglob("*")) if not p.is_dir()}


def ckpt(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "engine.run.ckpt_cli", *args],
                          capture_output=True, text=True, timeout=timeout, env=ENV,
                          stdin=subprocess.DEVNULL)


def small_checkpoints(root: Path, steps: tuple[int, ...]) -> list[Path]:
    out = []
    for step in steps:
        info = write_checkpoint(root / "checkpoints", step, np.full(16, step, np.float32),
                                np.zeros(16, np.float32), np.ones(16, np.float32),
                                {"tokens": step}, "periodic", TABLE)
        out.append(info.path)
    return out


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory, prepared_data: Path) -> tuple[Path, Path]:
    """A config and the run directory it trained to the end (checkpoints at steps 10, 20)."""
    root = tmp_path_factory.mktemp("inputs")
    cfg = root / "cfg.json"
    cfg.write_text(json.dumps(micro_config_dict(max_steps=20)))
    r = run_engine(cfg, root / "run")
    assert r.returncode == 0, r.stdout + r.stderr
    return cfg, root / "run"


# ---------------------------------------------------------------- memory and the build


def test_a_run_the_host_cannot_hold_is_refused_with_the_figures(tmp_path: Path,
                                                                write_config) -> None:
    cfg = write_config(micro_config_dict(max_steps=3))
    run = tmp_path / "run"
    r = run_engine(cfg, run, env={"ANDREA_TEST_MEM_AVAILABLE": str(1 << 20)})
    assert r.returncode == 2, r.stdout + r.stderr
    line = one_line(r)
    for part in ("ANDREA-micro on the numpy backend: needs", "of host memory", "weights",
                 "adam_m", "activations", "host_checkpoint_copy", "safety margin",
                 "1.0 MiB available (ANDREA_TEST_MEM_AVAILABLE)"):
        assert part in line, line
    assert not run.exists()  # refused before anything: no trace of a run that never was


def test_a_refused_resume_leaves_the_run_directory_as_it_was(finished, tmp_path: Path) -> None:
    cfg, src = finished
    run = tmp_path / "run"
    shutil.copytree(src, run)
    before = files_of(run)
    r = run_engine(cfg, run, "--resume", "--max-steps", "25",
                   env={"ANDREA_TEST_MEM_AVAILABLE": str(1 << 20)})
    assert r.returncode == 2, r.stdout + r.stderr
    line = one_line(r)
    # the checkpoint already read serves as the checkpoint copies; the initial weights do not
    assert "initial_weights" in line and "host_checkpoint_copy" not in line, line
    assert files_of(run) == before


def test_the_plan_counts_the_checkpoint_copies_on_either_backend(monkeypatch) -> None:
    from engine.backends import hostmem
    from engine.config import parse_config
    from engine.errors import UserError
    from engine.model.layout import ModelShapes, n_params
    from engine.run.memcheck import require_host_memory, run_host_plan

    cfg = parse_config(micro_config_dict(), "micro", ROOT, check_paths=False)
    n = n_params(ModelShapes.from_config(cfg.model))
    numpy_plan = run_host_plan(cfg, "numpy", resumed=False)
    assert numpy_plan["host_checkpoint_copy"] == 12 * n and numpy_plan["weights"] == 4 * n
    assert run_host_plan(cfg, "cuda", resumed=False) == {"host_checkpoint_copy": 12 * n}
    assert run_host_plan(cfg, "cuda", resumed=True) == {"initial_weights": 4 * n}
    # enough for the numpy backend's own buffers and the margin, not for the copies beside them
    own = sum(v for k, v in numpy_plan.items() if k != "host_checkpoint_copy")
    monkeypatch.setenv(hostmem.TEST_AVAILABLE_ENV, str(own + hostmem.margin(own) + 1))
    hostmem.require({k: v for k, v in numpy_plan.items() if k != "host_checkpoint_copy"}, "x")
    with pytest.raises(UserError, match="host_checkpoint_copy"):
        require_host_memory(cfg, "numpy", resumed=False)


def test_cgroup_limits_are_read_at_every_level(tmp_path: Path) -> None:
    from engine.backends.hostmem import cgroup_headroom

    fs = tmp_path / "cg"
    (fs / "a" / "b").mkdir(parents=True)
    (tmp_path / "v2").write_text("0::/a/b\n")
    (fs / "a" / "b" / "memory.max").write_text("max\n")
    (fs / "a" / "memory.max").write_text(f"{8 << 30}\n")
    (fs / "a" / "memory.current").write_text(f"{6 << 30}\n")
    (fs / "a" / "memory.stat").write_text(
        f"anon 1\nfile {4 << 30}\nshmem {1 << 30}\nactive_file {1 << 30}\n"
        f"inactive_file {2 << 30}\n")
    # 8 GiB limit, 6 GiB used of which 3 GiB is file cache the kernel reclaims (active or not;
    # tmpfs and shared memory are not): 5 GiB left
    assert cgroup_headroom(fs, tmp_path / "v2") == 5 << 30
    assert cgroup_headroom(tmp_path / "none", tmp_path / "v2") is None
    v1 = fs / "memory"
    v1.mkdir()
    (tmp_path / "v1").write_text("4:memory:/elsewhere/on/the/host\n")
    (v1 / "memory.limit_in_bytes").write_text(f"{4 << 30}\n")
    (v1 / "memory.usage_in_bytes").write_text(f"{1 << 30}\n")
    (v1 / "memory.stat").write_text("total_inactive_file 0\n")
    assert cgroup_headroom(fs, tmp_path / "v1") == 3 << 30
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    assert cgroup_headroom(fs, tmp_path / "v1") is None


SLOW_BUILD = r"""
import sys, time
from pathlib import Path
import engine.train.trainer as trainer
real = trainer.init_params
def slow(shapes, seed):  # a build that takes a long time (a model of billions of parameters)
    Path(sys.argv[1]).write_text("building")
    for _ in range(6000):
        time.sleep(0.1)
    return real(shapes, seed)
trainer.init_params = slow
from engine.run.cli import main
main(sys.argv[2:])
"""


def test_a_stop_during_the_build_ends_the_start(tmp_path: Path, write_config) -> None:
    cfg = write_config(micro_config_dict(max_steps=3))
    run, marker = tmp_path / "run", tmp_path / "building"
    cmd = [sys.executable, "-c", SLOW_BUILD, str(marker), *engine_cmd(cfg, run)[3:]]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=ENV)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        # the build alone would take 600 s: the bound is generous, not tight
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out
    assert "SIGTERM during start-up; nothing was trained" in out
    assert json.loads((run / "state.json").read_text())["status"] == "stopped"
    assert not (run / "checkpoints").exists() or not any((run / "checkpoints").iterdir())
    assert (run / "loss.jsonl").read_text() == ""


def test_the_initial_weights_are_the_same_drawn_in_chunks(monkeypatch) -> None:
    from engine.model import layout
    from engine.model.layout import ModelShapes

    shapes = ModelShapes(n_layer=2, d_model=64, n_head=2, d_ff=128, vocab_size=300, seq_len=32)
    whole = layout.init_params(shapes, 7)
    monkeypatch.setattr(layout, "INIT_CHUNK", 1000)  # odd cuts inside every tensor
    assert np.array_equal(whole.view(np.uint32), layout.init_params(shapes, 7).view(np.uint32))
    rng = np.random.Generator(np.random.PCG64(7))  # one draw per tensor, as documented
    wte = rng.standard_normal(300 * 64, dtype=np.float32) * np.float32(layout.INIT_STD)
    assert np.array_equal(whole[: 300 * 64], wte)


# ---------------------------------------------------------------- FIFOs, devices, pipes


def test_a_fifo_as_config_is_refused_at_once(tmp_path: Path, prepared_data: Path) -> None:
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    r = subprocess.run(engine_cmd(fifo, tmp_path / "run"), capture_output=True, text=True,
                       timeout=60, env=ENV, stdin=subprocess.DEVNULL)
    assert r.returncode == 2, r.stderr
    line = one_line(r)
    assert f"{fifo}: is a FIFO (a named pipe) with no writer" in line, line
    assert not (tmp_path / "run").exists()


def test_a_device_as_config_is_refused(tmp_path: Path) -> None:
    r = subprocess.run(engine_cmd(Path("/dev/zero"), tmp_path / "run"), capture_output=True,
                       text=True, timeout=60, env=ENV, stdin=subprocess.DEVNULL)
    assert r.returncode == 2
    assert one_line(r) == "error: /dev/zero: is a character device, expected a regular file"


def _has_open(pid: int, path: Path) -> bool:
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") == str(path):
                return True
        except OSError:
            pass
    return False


def test_a_stop_ends_the_wait_for_a_config_pipe(tmp_path: Path) -> None:
    fifo = tmp_path / "slow.json"
    os.mkfifo(fifo)
    writer = os.open(fifo, os.O_RDWR)  # a writer that never finishes its config
    os.write(writer, b'{"name": ')
    proc = subprocess.Popen(engine_cmd(fifo, tmp_path / "run"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        deadline = time.monotonic() + 60
        while not _has_open(proc.pid, fifo):  # the engine is reading it
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        os.close(writer)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130 and err.strip() == "interrupted", err
    assert not (tmp_path / "run").exists()


PIPE_WAIT = r"""
import sys
from engine import infile
from engine.config import load_config
infile.PIPE_WAIT_S = 0.3
load_config(sys.argv[1])
"""


def test_a_pipe_that_never_ends_is_refused_after_the_wait(tmp_path: Path) -> None:
    fifo = tmp_path / "slow.json"
    os.mkfifo(fifo)
    writer = os.open(fifo, os.O_RDWR)  # a writer that never finishes its config
    try:
        os.write(writer, b'{"name": ')
        r = subprocess.run([sys.executable, "-c", PIPE_WAIT, str(fifo)], capture_output=True,
                           text=True, timeout=60, env=ENV)
    finally:
        os.close(writer)
    assert r.returncode != 0
    assert f"ConfigError: {fifo}: is a pipe whose writer did not finish within 0.3 s" in \
        r.stderr, r.stderr


READERS = r"""
import sys
from pathlib import Path
from engine.runfiles import JsonlTail, read_json, tail_lines, tail_text
p = Path(sys.argv[1])
print(read_json(p), tail_lines(p, 100), tail_text(p, 5), JsonlTail(p).read_new())
"""


def test_the_run_file_readers_pass_over_a_fifo(tmp_path: Path) -> None:
    fifo = tmp_path / "engine.log"
    os.mkfifo(fifo)
    r = subprocess.run([sys.executable, "-c", READERS, str(fifo)], capture_output=True,
                       text=True, timeout=60, env=ENV)
    assert r.returncode == 0 and r.stdout.strip() == "None [] [] []", r.stderr


def test_a_fifo_in_the_run_directory_does_not_hold_the_engine(tmp_path: Path,
                                                              write_config) -> None:
    cfg = write_config(micro_config_dict(max_steps=2))
    run = tmp_path / "run"
    run.mkdir()
    for name in ("state.json", "engine.json", "config.json", "engine.lock"):
        os.mkfifo(run / name)
    r = run_engine(cfg, run, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads((run / "state.json").read_text())["status"] == "finished"


@pytest.mark.parametrize("name", ["loss.jsonl", "events.jsonl", "engine.log"])
def test_a_fifo_in_place_of_a_file_the_engine_appends_to_is_refused(finished, tmp_path: Path,
                                                                     name: str) -> None:
    """The engine appends to its run files on a resume: a FIFO in one's place (nobody reading
    it) is refused in one line, never waited on."""
    cfg, done = finished
    run = tmp_path / "run"
    shutil.copytree(done, run)
    _fifo_in_place_of(run / name)
    r = run_engine(cfg, run, "--resume", "--max-steps", "25", timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"{run / name}: is a FIFO (a named pipe), expected a regular file" in one_line(r)
    assert (run / name).is_fifo()


def test_a_link_in_place_of_the_lock_is_refused(tmp_path: Path, write_config) -> None:
    """A dangling symbolic link named engine.lock: one line, not a loop that ignores SIGTERM."""
    cfg = write_config(micro_config_dict(max_steps=2))
    run = tmp_path / "run"
    run.mkdir()
    (run / "engine.lock").symlink_to(tmp_path / "nowhere" / "lockfile")
    r = run_engine(cfg, run, timeout=60)
    assert r.returncode == 2
    assert "engine.lock: cannot open the run's lock: a symbolic link" in one_line(r)
    assert (run / "engine.lock").is_symlink() and not (tmp_path / "nowhere").exists()


def test_a_config_through_process_substitution_still_trains(tmp_path: Path,
                                                             write_config) -> None:
    cfg = write_config(micro_config_dict(max_steps=2))
    run = tmp_path / "run"
    script = 'exec "$0" -m engine.run.cli <(cat "$1") --run-dir "$2" --backend numpy'
    r = subprocess.run(["bash", "-c", script, sys.executable, str(cfg), str(run)],
                       capture_output=True, text=True, timeout=300, env=ENV, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads((run / "state.json").read_text())["status"] == "finished"
    assert json.loads((run / "config.json").read_text())["name"] == "ANDREA-micro"


def test_data_parallel_ranks_refuse_a_config_pipe_they_cannot_reread(tmp_path: Path,
                                                                       write_config) -> None:
    cfg = write_config(micro_config_dict(max_steps=2))
    run = tmp_path / "run"
    script = 'exec "$0" -m engine.run.cli <(cat "$1") --run-dir "$2" --backend numpy --gpus 2'
    r = subprocess.run(["bash", "-c", script, sys.executable, str(cfg), str(run)],
                       capture_output=True, text=True, timeout=60, env=ENV, cwd=tmp_path)
    assert r.returncode == 2
    assert "needs the config as a file" in one_line(r)
    assert not run.exists()


def _fifo_in_place_of(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


@pytest.mark.parametrize("name", ["state.json", "model.ckpt"])
def test_a_fifo_in_a_checkpoint_is_refused_by_verify_and_inspect(tmp_path: Path,
                                                                 name: str) -> None:
    run = tmp_path / "run"
    newer, older = small_checkpoints(run, (20, 10))[::-1]
    _fifo_in_place_of(older / name)
    want = f"{older / name}: is a FIFO (a named pipe), expected a regular file"
    for cmd in ("verify", "inspect"):
        for target in (run, older):  # the whole run (it lists state.json files), and the one
            r = ckpt(cmd, str(target), timeout=30)
            assert r.returncode == 2, (cmd, target, r.stdout, r.stderr)
            assert want in r.stdout + r.stderr, (cmd, target, r.stdout, r.stderr)
            assert "Traceback" not in r.stderr
    assert ckpt("verify", str(newer)).returncode == 0


# ---------------------------------------------------------------- one line, not a traceback


def test_an_undecodable_prompt_is_one_line(finished) -> None:
    _, run = finished
    r = subprocess.run([sys.executable, "-m", "engine.run.sample_cli", str(run), "--prompt",
                        b"abc\xff\xfe\x80def", "--backend", "numpy"], capture_output=True,
                       timeout=120, env=ENV, stdin=subprocess.DEVNULL)
    err = r.stderr.decode()
    assert r.returncode == 2 and "Traceback" not in err, err
    assert err.strip() == ("error: --prompt: not valid UTF-8 at byte 3 (0xff); the prompt must "
                           "be UTF-8 text")
    assert r.stdout == b""


def _prune_refused(run: Path, r: subprocess.CompletedProcess[str], why: str) -> None:
    assert r.returncode == 2, r.stdout + r.stderr
    line = one_line(r)
    assert f"{run / 'checkpoints'}: cannot delete checkpoints here ({why}); nothing was " \
           "removed" in line, line
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "step_00000010", "step_00000020", "step_00000030"]


def test_prune_in_a_read_only_run_directory_is_one_line(tmp_path: Path) -> None:
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-rm", "true"]).returncode:
        pytest.skip("no user namespaces here to make a read-only mount")
    run = tmp_path / "run"
    small_checkpoints(run, (10, 20, 30))
    script = 'mount --bind -o ro "$0" "$0" && exec "$@"'
    r = subprocess.run(["unshare", "-rm", "sh", "-c", script, str(run), sys.executable, "-m",
                        "engine.run.ckpt_cli", "prune", str(run), "--keep", "1"],
                       capture_output=True, text=True, timeout=60, env=ENV)
    _prune_refused(run, r, "read-only file system")


def test_prune_where_it_may_not_delete_is_one_line(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        pytest.skip("root deletes in a directory without write permission (the read-only "
                    "mount test covers root)")
    run = tmp_path / "run"
    small_checkpoints(run, (10, 20, 30))
    (run / "checkpoints").chmod(0o555)
    try:
        r = ckpt("prune", str(run), "--keep", "1")
    finally:
        (run / "checkpoints").chmod(0o755)
    _prune_refused(run, r, "permission denied")


# ---------------------------------------------------------------- thousands of step_* entries


def _bogus(root: Path, first: int, count: int) -> None:
    for step in range(first, first + count):
        (root / f"step_{step:08d}").mkdir()


def test_a_resume_past_many_bogus_entries_logs_a_summary(finished, tmp_path: Path) -> None:
    cfg, src = finished
    run = tmp_path / "run"
    shutil.copytree(src, run)
    _bogus(run / "checkpoints", 1000, 300)  # newer than the real ones: each is passed over
    r = run_engine(cfg, run, "--resume", "--max-steps", "21")
    assert r.returncode == 0, r.stdout + r.stderr
    log = (run / "engine.log").read_text().splitlines()
    skipping = [ln for ln in log if "resume: skipping" in ln]
    assert len(skipping) == 6, skipping[:10]
    assert "step_00001299" in skipping[0] and "and 295 more that do not verify" in skipping[-1]
    assert any("resume: from" in ln and "step_00000020" in ln for ln in log)
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    [resume] = [e for e in events if e["event"] == "resume"]
    assert len(resume["skipped"]) == 6
    assert resume["skipped"][-1]["reason"].startswith("and 295 more that do not verify")


def test_verify_of_many_bogus_entries_ends_in_a_bounded_line(tmp_path: Path) -> None:
    run = tmp_path / "run"
    small_checkpoints(run, (1,))
    _bogus(run / "checkpoints", 2, 50)
    r = ckpt("verify", str(run))
    assert r.returncode == 2
    line = one_line(r)
    assert line.endswith("50 of 51 checkpoints invalid: step_00000051, step_00000050, "
                         "step_00000049, step_00000048, step_00000047 and 45 more"), line


def test_the_checkpoint_browser_shows_rows_before_verifying(tmp_path: Path,
                                                            monkeypatch) -> None:
    from textual.widgets import DataTable

    from andrea_tui.ckpt_screens import CheckpointApp
    from engine import jsonio
    from engine.run import checkpoint_store

    small_checkpoints(tmp_path, (1,))  # the oldest entry is the one valid checkpoint
    _bogus(tmp_path / "checkpoints", 2, 3000)
    work = {"state_reads": 0, "verified": 0}
    at_first_row: dict[str, int] = {}
    read_bytes, verify, add_row = jsonio.read_bytes, checkpoint_store.verify_checkpoint, \
        DataTable.add_row

    def counted_read(path: Path, *a: Any, **kw: Any) -> bytes:
        work["state_reads"] += Path(path).name == "state.json"
        return read_bytes(path, *a, **kw)

    def counted_verify(*a: Any, **kw: Any) -> Any:
        work["verified"] += 1
        return verify(*a, **kw)

    def first_row(self: DataTable, *a: Any, **kw: Any) -> Any:
        at_first_row.setdefault("state_reads", work["state_reads"])
        at_first_row.setdefault("verified", work["verified"])
        return add_row(self, *a, **kw)

    monkeypatch.setattr(jsonio, "read_bytes", counted_read)
    monkeypatch.setattr(checkpoint_store, "verify_checkpoint", counted_verify)
    monkeypatch.setattr(DataTable, "add_row", first_row)

    async def go() -> tuple[int, str, list[Any]]:
        app = CheckpointApp(tmp_path)
        async with app.run_test(size=(120, 40)) as pilot:
            header = ""
            for _ in range(3000):
                header = str(app.screen.query_one("#ckpt-header").render())
                if "invalid" in header and "verifying" not in header:
                    break
                await pilot.pause(0.02)
            table = app.screen.query_one(DataTable)
            return table.row_count, header, list(app.screen.entries)

    rows, header, entries = asyncio.run(go())
    # the rows came from the listing alone: nothing was read or verified before they showed
    assert at_first_row == {"state_reads": 0, "verified": 0}
    assert work["verified"] == 3001
    assert header.startswith("3,001 found, 3,000 invalid (2,000 invalid beyond the first 1,000 "
                             "not shown"), header
    assert rows == 1001 and entries[-1].valid and entries[-1].step == 1  # never hidden
    assert all(not e.valid for e in entries[:-1])
