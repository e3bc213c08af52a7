"""Which LayerNorm row kernel a width gets, checked on the CPU: a row whose vectors fit the
kernel's registers (kernels/layernorm.cu LN_MAXV) takes it, a longer one up to twice that its
_wide twin, anything longer the first again (both take their scalar path there); every launch
matches its kernel's declared arguments. No GPU needed."""

from __future__ import annotations

from typing import Any

import pytest

from engine.backends.cuda.ops import Ops
from engine.backends.cuda.runtime import SIGNATURES


class Kernel:
    def __init__(self, name: str, calls: list[str]) -> None:
        self.name, self.calls = name, calls

    def prepared_async_call(self, grid: Any, block: Any, stream: Any, *args: Any,
                            shared_size: int = 0) -> None:
        assert len(args) == len(SIGNATURES[self.name]), (self.name, args)
        self.calls.append(self.name)


class Stream:
    handle = 0


def launches(precision: str, d: int) -> list[str]:
    calls: list[str] = []
    o = Ops({name: Kernel(name, calls) for name in SIGNATURES}, None, Stream(), precision)
    R, p = 64, 0x1000
    o.layernorm_fwd(p, p, p, p, p, p, R, d)
    o.residual_layernorm_fwd(p, p, p, p, p, p, p, p, R, d)
    o.layernorm_bwd(p, p, p, p, p, p, p, p, R, d, accumulate=True)
    return [c for c in calls if "layernorm" in c and "params" not in c]


@pytest.mark.parametrize(("precision", "d", "wide"), [
    ("bf16", 768, False), ("bf16", 1024, False), ("bf16", 1032, True), ("bf16", 2048, True),
    ("bf16", 2056, False), ("fp32", 512, False), ("fp32", 1024, True), ("fp32", 2048, False),
])
def test_a_row_gets_the_kernel_whose_registers_hold_it(precision: str, d: int,
                                                       wide: bool) -> None:
    names = launches(precision, d)
    assert names == [f"{n}{'_wide' if wide else ''}" for n in
                     ("k_layernorm_fwd", "k_residual_layernorm_fwd", "k_layernorm_bwd")]
