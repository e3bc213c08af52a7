"""scripts/bench_attention.py on a machine without its GPU set-up: bad settings and a missing
PyTorch get one line and exit status 2, never a traceback (the benchmark itself runs on an H200)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_attention.py"


def run(**env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("PROBE_")}
    full.update(env, FLEX_SITE="/nonexistent")
    return subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True,
                          timeout=60, env=full)


@pytest.mark.parametrize(("env", "says"), [
    ({"PROBE_B": "x"}, "PROBE_B='x': expected positive integers"),
    ({"PROBE_T": "0"}, "PROBE_T='0': expected positive integers"),
    ({"PROBE_B": "8,4"}, "PROBE_B='8,4': expected one positive integer"),
    ({"PROBE_HEADS": "12,,6"}, "PROBE_HEADS='12,,6': expected positive integers"),
    ({"PROBE_LAYOUTS": "bshd,rows"}, "PROBE_LAYOUTS='bshd,rows': expected bshd and/or engine"),
])
def test_bad_settings_get_one_line_and_exit_status_2(env: dict[str, str], says: str) -> None:
    p = run(**env)
    assert p.returncode == 2 and says in p.stderr, p.stderr
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_without_pytorch_it_says_so() -> None:
    try:
        import torch  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("PyTorch is installed here")
    p = run()
    assert p.returncode == 2 and "needs PyTorch" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr
