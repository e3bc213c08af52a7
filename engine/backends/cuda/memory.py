"""Device memory, planned then allocated once (DESIGN §5): named buffers carved out of one
allocation per group, 256-byte aligned (cuBLAS picks the same kernels for the same alignment)."""

from __future__ import annotations

from typing import Any

ALIGN = 256
GROUPS = ("weights", "grads", "adam_m", "adam_v", "activations", "scratch", "fp8", "flex")
# groups a plan names only when it has them (train/precision "fp8"; the flex attention
# backward's scratch and plan arrays, flex_attn.plan_buffers)
OPTIONAL = ("fp8", "flex")


class Plan:
    """Buffers by group; `allocate` makes one device allocation per group."""

    def __init__(self) -> None:
        self._offsets: dict[str, tuple[str, int]] = {}
        self.sizes = dict.fromkeys(GROUPS, 0)
        self._bases: dict[str, int] = {}
        self._allocs: list[Any] = []

    def add(self, group: str, name: str, nbytes: int) -> None:
        if name in self._offsets:
            raise ValueError(f"buffer {name!r} planned twice")
        self._offsets[name] = (group, self.sizes[group])
        self.sizes[group] += -(-max(nbytes, 1) // ALIGN) * ALIGN

    def totals(self) -> dict[str, int]:
        out = {k: v for k, v in self.sizes.items() if v or k not in OPTIONAL}
        out["total"] = sum(self.sizes.values())
        return out

    def allocate(self, drv: Any) -> None:
        for group, size in self.sizes.items():
            if size:
                mem = drv.mem_alloc(size)
                self._allocs.append(mem)
                self._bases[group] = int(mem)

    def span(self, group: str) -> tuple[int, int]:
        """(device address, bytes) of one group's allocation (after `allocate`)."""
        return self._bases[group], self.sizes[group]

    def __getitem__(self, name: str) -> int:
        group, offset = self._offsets[name]
        return self._bases[group] + offset

    def free(self) -> None:
        for mem in self._allocs:
            mem.free()
        self._allocs.clear()
        self._bases.clear()


def format_plan(plan: dict[str, int]) -> str:
    return ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in plan.items())
