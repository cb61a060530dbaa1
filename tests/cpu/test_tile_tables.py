"""The tile tables of the flat contract's GEMMs (``kernels.matmul.ROW_TMA``, ``DOWN_TOKENS`` by the row count;
the MoE's ``GROUPED_UP_ROWS`` and ``DOWN_TMA`` by the rows per expert: test_moe_tiles.py): the count picks the tile
by the table's bounds, a table must end unbounded, every grouped tile divides the expert blocks, and the launchers
refuse a down projection without its token count. That the tiles compute the same bits is a
GPU property (tests/gpu/test_kernels_gpu.py: every tile == the pointer kernel at 1 to 4096 rows,
and batch invariance across the bound)."""

import pytest
from true_on_policy.kernels import matmul as mm
from true_on_policy.kernels.limits import KernelLimitError


def test_by_rows_follows_the_bounds():
    for table in (mm.ROW_TMA, mm.DOWN_TOKENS):
        small, large = mm.table_tiles(table)
        assert table[0][0] == mm.DECODE_ROWS and table[-1][0] is None
        assert all(mm.by_rows(table, n) is small for n in (1, 64, mm.DECODE_ROWS))
        assert all(mm.by_rows(table, n) is large for n in (mm.DECODE_ROWS + 1, 4096, 1 << 20))
        assert small != large
        assert all(mm.ALIGN % cfg["BLOCK_M"] == 0 for cfg in (small, large))
    for table in (mm.GROUPED_UP_ROWS, mm.DOWN_TMA):
        assert table[-1][0] is None and all(mm.ALIGN % cfg["BLOCK_M"] == 0 for cfg in mm.table_tiles(table))
    one = mm.TMA["plain"]
    assert mm.by_rows(one, 1) is one is mm.by_rows(one, 4096) and mm.table_tiles(one) == [one]
    assert mm.TMA["row"] is mm.ROW_TMA


def test_a_table_without_an_unbounded_entry_is_refused():
    with pytest.raises(KernelLimitError, match="unbounded"):
        mm.by_rows(((8, mm.TMA["plain"]),), 9)


def test_grouped_down_needs_its_token_count():
    import torch

    x, w = torch.zeros(mm.ALIGN, 64, dtype=torch.bfloat16), torch.zeros(2, 32, 64, dtype=torch.bfloat16)
    rows, be = torch.zeros(mm.ALIGN, dtype=torch.int64), torch.zeros(1, dtype=torch.int32)
    for role, tokens in (("down", None), ("gate", 4)):
        with pytest.raises(KernelLimitError, match="role must be"):
            mm.grouped_matmul(x, w, rows, be, role=role, tokens=tokens)
