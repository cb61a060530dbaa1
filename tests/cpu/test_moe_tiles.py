"""The MoE's grouped GEMMs above the decode path: their tile by the rows per expert (``kernels.matmul.moe_tile``).

- the gate/up takes GROUPED_UP_ROWS' and the flat down projection DOWN_TMA's tile for the rows an expert in
  use receives (``expert_groups``), so two layers at one token count can take different tiles and two token
  counts with the same rows per expert the same one; without the call's slots, or with
  TRUE_ON_POLICY_MOE_TILES=tokens (``MOE_TOKEN_TILES``), GROUPED_UP_TMA and DOWN_TOKENS by the token count;
- ``grouped_matmul`` launches exactly that tile where the decode tiles do not apply (the launch recorded,
  not run);
- the programs of those GEMMs and of v1's grouped tree down projection above the decode path run in groups of
  MOE_GROUP_M M blocks (``program_tile``); on the decode path, and under TRUE_ON_POLICY_MOE_ORDER=columns
  (``MOE_COLUMN_ORDER``), in the 2-D grid's column order;
- the modes, 'rows' (also unset) or 'tokens' and 'grouped' (also unset) or 'columns', their parsing, their refusal
  of any other value and the patches setting the flags and saying so: test_speed_switches.py.

That every tile of the tables computes the same bits: interpreted in test_decode_tiles.py (every tile the rule
gives at three layer shapes, 1 to 4096 rows), on the GPU in tests/gpu/test_kernels_gpu.py
(``test_grouped_decode_tiles_equal_pointer``, ``test_down_tma_tiles_equal_column``). That the order changes no
bit: interpreted in interpreted/program_order.py, on the GPU in ``test_program_order_changes_no_bit``.
"""

import pytest
import torch
import triton
from true_on_policy.kernels import grouped_tma, seg_tree
from true_on_policy.kernels import matmul as mm

WIDE = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3)
MID = dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3)
NARROW = dict(BLOCK_M=32, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4)


@pytest.fixture(autouse=True)
def _by_rows(monkeypatch):
    monkeypatch.setattr(mm, "MOE_TOKEN_TILES", False)
    monkeypatch.setattr(mm, "MOE_COLUMN_ORDER", False)


@pytest.mark.parametrize("tokens,experts,top_k,up,down", [
    (4096, 128, 8, WIDE, WIDE),    # 256 rows an expert (30B-A3B and 235B-A22B layers)
    (1024, 128, 8, WIDE, MID),     # 64
    (512, 128, 8, MID, MID),       # 32
    (257, 128, 8, MID, NARROW),    # 17
    (512, 256, 6, MID, NARROW),    # 12 (h1536e256k6)
    (2048, 256, 6, MID, MID),      # 48
    (8192, 256, 6, WIDE, WIDE),    # 192
    (4096, 64, 4, WIDE, WIDE),     # 256 (h3072e64k4)
])
def test_the_tile_follows_the_rows_per_expert(tokens, experts, top_k, up, down):
    rows = mm.expert_groups(tokens * top_k, experts)[1]
    assert mm.moe_tile("plain", tokens, tokens * top_k, experts) == up, rows
    assert mm.moe_tile("down", tokens, tokens * top_k, experts) == down, rows
    assert mm.moe_tile("plain", tokens, tokens * top_k, experts) is mm.by_rows(mm.GROUPED_UP_ROWS, rows)
    assert mm.moe_tile("down", tokens, tokens * top_k, experts) is mm.by_rows(mm.DOWN_TMA, rows)


def test_one_token_count_two_layers_two_tiles():
    """512 tokens: 32 rows an expert of 128 at top-8 (the middle tile), 12 of 256 at top-6 (the narrow one)."""
    assert mm.moe_tile("down", 512, 512 * 8, 128) is not mm.moe_tile("down", 512, 512 * 6, 256)
    assert mm.moe_tile("down", 512, 512 * 8, 128) == MID and mm.moe_tile("down", 512, 512 * 6, 256) == NARROW


def test_the_bounds_hold_at_their_edges():
    for table in (mm.GROUPED_UP_ROWS, mm.DOWN_TMA):
        bounds = [b for b, _ in table]
        assert bounds[-1] is None and bounds[:-1] == sorted(bounds[:-1])
        for (b, cfg), (_, nxt) in zip(table[:-1], table[1:], strict=True):
            assert mm.by_rows(table, b) is cfg and mm.by_rows(table, b + 1) is nxt


def test_by_tokens_or_without_slots_the_count_decides(monkeypatch):
    for tokens in (1, 256, 257, 512, 4096):
        assert mm.moe_tile("plain", tokens, None, 128) is mm.GROUPED_UP_TMA
        assert mm.moe_tile("down", tokens, None, 128) is mm.by_rows(mm.DOWN_TOKENS, tokens)
    monkeypatch.setattr(mm, "MOE_TOKEN_TILES", True)
    for tokens, experts, top_k in ((512, 256, 6), (4096, 128, 8), (1024, 64, 4)):
        assert mm.moe_tile("plain", tokens, tokens * top_k, experts) is mm.GROUPED_UP_TMA
        assert mm.moe_tile("down", tokens, tokens * top_k, experts) is mm.by_rows(mm.DOWN_TOKENS, tokens)
    # 512 tokens over 256 experts: by the count, the wide tile; by the rows (12 an expert), the narrow one
    assert mm.moe_tile("down", 512, 512 * 6, 256) == WIDE


def test_every_tile_of_the_tables_is_a_candidate_the_gpu_tier_checks():
    for cfg in mm.table_tiles(mm.GROUPED_UP_ROWS) + [mm.GROUPED_UP_TMA]:
        assert cfg in mm.candidate_tiles("gate_up")
    for cfg in mm.table_tiles(mm.DOWN_TMA) + mm.table_tiles(mm.DOWN_TOKENS):
        assert cfg in mm.candidate_tiles("down")
    assert {c["BLOCK_K"] for c in mm.table_tiles(mm.GROUPED_UP_ROWS) + mm.table_tiles(mm.DOWN_TMA)} == \
        {mm.GROUPED_UP_TMA["BLOCK_K"]}  # the K chunks of every tile: the same MMA steps from k = 0


@pytest.mark.parametrize("by_tokens", [False, True])
@pytest.mark.parametrize("tokens,experts,top_k", [(512, 256, 6), (1024, 128, 8), (4096, 128, 8), (300, 16, 2)])
def test_grouped_matmul_launches_the_rule_s_tile(tokens, experts, top_k, by_tokens, monkeypatch):
    """Above the decode path (``grouped_decode`` false) the gate/up and the down projection launch
    ``moe_tile``'s tile, one per program over the whole table."""
    monkeypatch.setattr(mm, "MOE_TOKEN_TILES", by_tokens)
    monkeypatch.setattr(grouped_tma, "usable", lambda x, w: True)
    launched = []

    def launch(x, w, out, rows, block_expert, count, cfg, subtiles=1, glu=False, segments=1, group=0):
        launched.append((cfg, count, subtiles, block_expert.shape[0], group))
        return out
    monkeypatch.setattr(grouped_tma, "launch", launch)
    slots = tokens * top_k
    blocks = triton.cdiv(slots, mm.ALIGN) + experts
    rows, be = torch.zeros(blocks * mm.ALIGN, dtype=torch.int64), torch.zeros(blocks, dtype=torch.int32)
    assert not mm.grouped_decode(tokens, slots, experts)
    for role, k in (("plain", 64), ("down", 32)):
        x, w = torch.zeros(tokens, k, dtype=torch.bfloat16), torch.zeros(experts, 48, k, dtype=torch.bfloat16)
        mm.grouped_matmul(x, w, rows, be, torch.float32, 1, tree=False, role=role, tokens=tokens, slots=slots)
        cfg, count, subtiles, n_be, group = launched.pop()
        assert cfg is mm.moe_tile(role, tokens, slots, experts), (role, cfg)
        assert (count, subtiles, n_be) == (rows.shape[0], 1, rows.shape[0] // cfg["BLOCK_M"])
        assert group == mm.MOE_GROUP_M > 0, group


@pytest.mark.parametrize("columns", [False, True])
@pytest.mark.parametrize("tokens,decode", [(4, True), (64, True), (300, False), (4096, False)])
def test_programs_run_in_groups_above_the_decode_path(tokens, decode, columns, monkeypatch):
    """The gate/up, the flat down projection (TMA) and v1's tree down projection (``seg_tree``): in groups of
    MOE_GROUP_M M blocks above the decode path, in the column order on it or with the order off."""
    experts, top_k, k = 128, 8, 768
    monkeypatch.setattr(mm, "MOE_COLUMN_ORDER", columns)
    monkeypatch.setattr(mm, "sm_count", lambda x: 132)
    monkeypatch.setattr(mm, "INTERPRETED", False)
    tma, launched = [True], []
    monkeypatch.setattr(grouped_tma, "usable", lambda x, w: tma[0])
    monkeypatch.setattr(grouped_tma, "launch", lambda *a, **kw: launched.append(("tma", kw["group"])) or a[2])
    monkeypatch.setattr(seg_tree, "launch", lambda *a, **kw: launched.append(("tree", kw["group"])) or a[2])
    slots = tokens * top_k
    blocks = triton.cdiv(slots, mm.ALIGN) + experts
    rows, be = torch.zeros(blocks * mm.ALIGN, dtype=torch.int64), torch.zeros(blocks, dtype=torch.int32)
    assert mm.grouped_decode(tokens, slots, experts) is decode
    x, w = torch.zeros(tokens, k, dtype=torch.bfloat16), torch.zeros(experts, 48, k, dtype=torch.bfloat16)
    for role in ("plain", "down"):
        mm.grouped_matmul(x, w, rows, be, torch.float32, 1, tree=False, role=role, tokens=tokens, slots=slots)
    tma[0] = False  # v1's down projection, an 8-segment tree: seg_tree whether or not TMA is usable
    mm.grouped_matmul(x, w, rows, be, torch.float32, 8, tree=True, role="plain", tokens=tokens, slots=slots)
    group = 0 if decode or columns else mm.MOE_GROUP_M
    assert launched == [("tma", group), ("tma", group), ("tree", group)], launched
