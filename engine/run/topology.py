"""How the GPUs of a data-parallel job are linked and how NCCL reduces over them: reported at
start and recorded in the `ready` event, since with more than two ranks the order of a sum (the
NCCL algorithm and protocol) decides its bits, and so whether two runs can agree.
"""

from __future__ import annotations

import os
import shutil
import subprocess

# More than two ranks: the sum's order depends on NCCL's choices; fix them unless the user did.
PINNED = {"NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple"}
NCCL_VARS = ("NCCL_ALGO", "NCCL_PROTO", "NCCL_NVLS_ENABLE", "NCCL_P2P_LEVEL", "NCCL_IB_HCA",
             "NCCL_SOCKET_IFNAME")


def pin_reduction_order(env: dict[str, str], world: int) -> dict[str, str]:
    """The environment for a rank of `world`: NCCL's algorithm and protocol pinned when the
    job has more than two ranks and the user left them open (two ranks: one add, any order)."""
    if world <= 2:
        return env
    return {**PINNED, **env}


def parse_topo(text: str) -> dict[str, str]:
    """`nvidia-smi topo -m`: the link between each pair of GPUs, e.g. {"0-1": "NV18"}."""
    rows = [ln.split() for ln in text.splitlines() if ln.strip().startswith("GPU")]
    header = next((r for r in rows if all(c.startswith("GPU") for c in r[:2])), None)
    links: dict[str, str] = {}
    for r in rows:
        if r is header or len(r) < 2 or not r[0][3:].isdigit():
            continue
        i = int(r[0][3:])
        for j, link in enumerate(r[1:]):
            if link.startswith(("NV", "PIX", "PXB", "PHB", "NODE", "SYS")) and i < j:
                links[f"{i}-{j}"] = link
    return links


def describe(nccl_version: int | None = None) -> dict[str, object]:
    """Links between this host's GPUs and the NCCL settings in force (never raises)."""
    links: dict[str, str] = {}
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "topo", "-m"], capture_output=True, text=True,
                                 timeout=10).stdout
            links = parse_topo(out)
        except (OSError, subprocess.SubprocessError):
            pass
    return {"links": links, "nccl_version": nccl_version,
            "nccl": {k: os.environ[k] for k in NCCL_VARS if k in os.environ}}
