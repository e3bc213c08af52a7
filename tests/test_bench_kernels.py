"""The kernel benchmark's command line and tables (scripts/bench_kernels.py), without a GPU: bad
arguments get one line and exit status 2; the table's ratios and rates come from the medians."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_kernels", ROOT / "scripts" / "bench_kernels.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize(("args", "says"), [
    (["--ops", "loss,foo"], "--ops wants some of layernorm, loss"),
    (["--ops", ""], "--ops wants some of layernorm, loss"),
    (["--vocab", "0"], "--vocab wants a positive integer, got 0"),
    (["--reps", "-2"], "--reps wants a positive integer, got -2"),
    (["--rounds", "0"], "--rounds wants a positive integer, got 0"),
    (["--shapes", "8192"], "--shapes wants ROWSxD"),
    (["--rows", "x"], "--rows integers"),
])
def test_bad_arguments_are_one_line_and_status_2(args, says):
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_kernels.py"), *args],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert says in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_without_a_gpu_it_says_so():
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_kernels.py"), "--ops", "loss"],
                       capture_output=True, text=True, timeout=60)
    if r.returncode == 0:
        pytest.skip("a usable GPU is here")
    assert r.returncode == 2 and "needs a CUDA GPU" in r.stderr and "Traceback" not in r.stderr


def test_the_table_takes_medians_against_the_reference(capsys):
    times = {"kernel": [90.0, 80.0, 100.0], "copy of the same bytes": [40.0, 50.0, 60.0]}
    _bench().print_table(times, "copy of the same bytes", "vs copy", "GB/s", 250.0)
    rows = capsys.readouterr().out.splitlines()
    assert rows[0].split() == ["variant", "us/call", "spread", "vs", "copy", "GB/s"]
    kernel = rows[1].split()
    assert kernel == ["kernel", "90.00", "22.2%", "1.80", "2778"]  # 250 MB in 90 µs
    assert rows[2].split()[-3:] == ["40.0%", "1.00", "5000"]
