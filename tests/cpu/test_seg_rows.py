"""v1's tree down projection above the decode path takes its tile by the segment's width and the rows an expert in
use receives (``kernels.matmul.SEG_ROWS``, ``seg_prefill_tile``); ROW_SEG at any other width, without slots, and
under TREE_FIXED (``TRUE_ON_POLICY_TREE_TILE=fixed``). The table is the committed sweep's choice: at every token
count the sweep ran, the table's tile is within 4 % of the fastest tile by pointer loads and faster than ROW_SEG in
the rollout's order of programs, with the reference's bits. That every tile computes the same bits on the GPU is the GPU tier's
(tests/gpu/test_kernels_gpu.py: test_seg_tree_equals_flat, test_program_order_changes_no_bit)."""

import json

import pytest
from helpers import ROOT
from true_on_policy.kernels import matmul as mm
from true_on_policy.kernels import seg_tree

# the sweep behind each width of the table (benchmarks/gemm_sweep.py --moe-geometry G --gemms down)
SWEEPS = {192: "bench-tree-down-a22b_h100.json", 96: "bench-tree-down-a3b48.json"}
EXPERTS, TOP_K = 128, 8


def _rows(tokens):
    return mm.expert_groups(tokens * TOP_K, EXPERTS)[1]


def test_every_width_of_the_table_has_its_sweep():
    assert set(mm.SEG_ROWS) == set(SWEEPS)


@pytest.mark.parametrize("seg", sorted(mm.SEG_ROWS))
def test_the_table_ends_unbounded_and_its_tiles_split_the_segment_and_the_expert_blocks(seg):
    table = mm.SEG_ROWS[seg]
    assert table[-1][0] is None
    for cfg in mm.table_tiles(table):
        assert seg_tree.fits(seg, cfg["BK"]) and mm.ALIGN % cfg["BLOCK_M"] == 0, (seg, cfg)
        assert cfg in mm.candidate_tiles("seg_tree"), cfg  # the GPU tier checks its bits


@pytest.mark.parametrize("tokens,seg,want", [(512, 192, (32, 64)), (1024, 192, (128, 64)), (2048, 192, (128, 64)),
                                             (8192, 192, (128, 64)), (512, 96, (64, 64)), (8192, 96, (64, 64))])
def test_the_tile_follows_the_width_and_the_rows_per_expert(tokens, seg, want, monkeypatch):
    monkeypatch.setattr(mm, "TREE_FIXED", False)
    cfg = mm.seg_prefill_tile(seg, tokens * TOP_K, EXPERTS)
    assert (cfg["BLOCK_M"], cfg["BLOCK_N"]) == want, (tokens, seg, cfg)
    monkeypatch.setattr(mm, "TREE_FIXED", True)
    assert mm.seg_prefill_tile(seg, tokens * TOP_K, EXPERTS) is mm.ROW_SEG


@pytest.mark.parametrize("seg,slots", [(64, 4096), (128, 4096), (320, 4096), (192, None), (96, None)])
def test_other_widths_and_calls_without_slots_keep_row_seg(seg, slots, monkeypatch):
    monkeypatch.setattr(mm, "TREE_FIXED", False)
    assert mm.seg_prefill_tile(seg, slots, EXPERTS) is mm.ROW_SEG


def _tag(cfg):
    return (f"seg_tree {cfg['BLOCK_M']}x{cfg['BLOCK_N']}x{cfg['BK']} w{cfg['num_warps']} s{cfg['num_stages']} "
            f"group {mm.MOE_GROUP_M}")


@pytest.mark.parametrize("seg", sorted(SWEEPS))
def test_the_table_is_the_committed_sweep_s_choice(seg, monkeypatch):
    doc = json.loads((ROOT / "evidence" / SWEEPS[seg]).read_text())
    shape = doc["moe_shape"]
    assert (shape["inter"] // 8, shape["experts"], shape["top_k"]) == (seg, EXPERTS, TOP_K)
    monkeypatch.setattr(mm, "TREE_FIXED", False)
    by_tokens = {}
    for r in doc["rows"]:
        by_tokens.setdefault(r["tokens"], {})[r["form"]] = r
    assert len(by_tokens) >= 4
    for tokens, rows in sorted(by_tokens.items()):
        assert all(r.get("same_bits") for r in rows.values() if r.get("ms")), tokens
        cfg = mm.seg_prefill_tile(seg, tokens * TOP_K, EXPERTS)
        mine = rows[_tag(cfg)]["ms"]
        pointer = [r["ms"] for f, r in rows.items() if f.startswith("seg_tree ") and " order " not in f and r.get("ms")]
        fixed = rows[_tag(mm.ROW_SEG)]["ms"]  # ROW_SEG in the rollout's order
        assert mine <= 1.04 * min(pointer), (tokens, _tag(cfg), mine, min(pointer))
        assert mine < fixed, (tokens, _tag(cfg), mine, fixed)
