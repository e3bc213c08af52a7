"""The CUDA graph helpers that need no GPU: k_fill's grid (graphs.FillKernel.grid), which covers
a memset's row with one 16-byte vector a thread up to FILL_MAX_BLOCKS blocks (the kernel strides
over the rest) and its rows up to the grid's y limit (the same)."""

from __future__ import annotations

from engine.backends.cuda.graphs import FILL_BLOCK, FILL_MAX_BLOCKS, FillKernel


def test_a_small_memset_takes_one_block() -> None:
    assert FillKernel.grid(1, 4, 1) == (1, 1)
    assert FillKernel.grid(0, 1, 0) == (1, 1)


def test_a_row_takes_a_vector_a_thread() -> None:
    assert FillKernel.grid(FILL_BLOCK * 4, 4, 3) == (1, 3)
    assert FillKernel.grid(FILL_BLOCK * 4 + 1, 4, 1) == (2, 1)
    assert FillKernel.grid(FILL_BLOCK * 16, 1, 1) == (1, 1)
    assert FillKernel.grid(FILL_BLOCK * 8 + 1, 2, 1) == (2, 1)


def test_the_grid_is_capped_where_the_kernel_strides() -> None:
    assert FillKernel.grid(1 << 30, 1, 70000) == (FILL_MAX_BLOCKS, 65535)
