"""The GPU topology and NCCL settings a data-parallel job reports and records."""

from __future__ import annotations

from engine.run.topology import PINNED, parse_topo, pin_reduction_order

TOPO_2 = """\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID
GPU0\t X \tNV18\t0-31\t0\t\tN/A
GPU1\tNV18\t X \t0-31\t0\t\tN/A
"""
TOPO_4 = """\tGPU0\tGPU1\tGPU2\tGPU3\tCPU Affinity
GPU0\t X \tNV18\tPXB\tSYS\t0-63
GPU1\tNV18\t X \tSYS\tPHB\t0-63
GPU2\tPXB\tSYS\t X \tNV12\t0-63
GPU3\tSYS\tPHB\tNV12\t X \t0-63
"""


def test_links_from_nvidia_smi_topo() -> None:
    assert parse_topo(TOPO_2) == {"0-1": "NV18"}
    assert parse_topo(TOPO_4) == {"0-1": "NV18", "0-2": "PXB", "0-3": "SYS", "1-2": "SYS",
                                  "1-3": "PHB", "2-3": "NV12"}
    assert parse_topo("") == {} and parse_topo("garbage\nGPU0 x") == {}


def test_reduction_order_is_pinned_beyond_two_ranks_unless_the_user_chose() -> None:
    assert pin_reduction_order({"A": "1"}, 2) == {"A": "1"}
    assert pin_reduction_order({}, 4) == PINNED
    assert pin_reduction_order({"NCCL_ALGO": "Tree"}, 8)["NCCL_ALGO"] == "Tree"
