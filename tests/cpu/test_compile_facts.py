"""benchmarks/compile_facts.py: what ptxas makes of ``seg_tree`` for sm_90a, on a machine without a GPU.

- A fresh compile of the row the docs lean on (a3b48's decode tile, 16 x 128 in the block loop of 8 row
  tiles, both weight fetches) gives the facts ``evidence/compile-seg-tree.json`` records, so the evidence
  is what this checkout's kernel and this Triton compile to.
- The compiler keeps the tree's arithmetic as written, in Triton's IR (TTIR) and in its GPU IR (TTGIR, where
  64-row tiles become warp-group MMAs): each segment's MMAs start from the zero tile and chain only through
  the segment's own chunks, and the fold is the loop's three fp32 additions. Triton may rewrite
  ``d + dot(a, b, 0)`` as ``dot(a, b, d)``, an MMA accumulating into ``d``, which rounds differently; the
  CPU interpreter would never see it, the GPU's bits would.
- The MoE's grouped GEMMs compile to the same instructions whatever the order of their programs
  (``matmul.program_tile``, ``MOE_GROUP_M``): a GPU compile of the grouped order, checked without a GPU.
- The tree down projection's start-up choice's candidates (``matmul.tree_candidates``) compile without a spill,
  within a block's shared memory, the tree's arithmetic as written; so do its decode tiles where the segments are
  too wide for ROW_SEG's stages (``matmul.wide_decode``).
"""

import json
import re
import sys

import pytest
from helpers import ROOT
from true_on_policy.kernels import matmul as mm


@pytest.fixture
def compile_facts(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import compile_facts

    yield compile_facts
    sys.modules.pop("compile_facts", None)


def test_the_committed_compile_facts_are_what_this_checkout_compiles(compile_facts):
    doc = json.loads((ROOT / "evidence" / "compile-seg-tree.json").read_text())
    row = next(r for r in doc["rows"] if r["geometry"] == "a3b48" and r["subtiles"] == 8
               and (r["tile"]["BLOCK_M"], r["tile"]["BLOCK_N"]) == (16, 128))
    for form in ("pointer", "tma"):
        got = compile_facts.facts(compile_facts.seg_tree_kernel(row["tile"], row["segment"], row["segments"],
                                                                row["subtiles"], form == "tma"))
        assert got == row[form], (form, got, row[form])


# (segment, tile, subtiles, weights by descriptor): one, two (chunk and tail) and three chunks a segment,
# the MMA-v2 tile in use at prefill, a warp-group tile, and a decode tile with its block loop
TREE_FORMS = [(64, (32, 128), 1, False), (96, (32, 128), 1, False), (192, (32, 128), 1, False),
              (96, (64, 64), 1, False), (192, (64, 64), 1, True), (96, (16, 128), 8, True)]


@pytest.mark.parametrize("seg,tile,sub,tma", TREE_FORMS, ids=[f"seg{s}-{t[0]}x{t[1]}-sub{b}-{'tma' if m else 'pointer'}"
                                                               for s, t, b, m in TREE_FORMS])
def test_the_compiled_tree_starts_each_segment_from_zero_and_folds_by_three_additions(compile_facts, seg, tile, sub,
                                                                                      tma):
    from true_on_policy.kernels import seg_tree

    cfg = dict(mm.ROW_SEG, BLOCK_M=tile[0], BLOCK_N=tile[1])
    _tree_as_written(compile_facts.seg_tree_kernel(cfg, seg, 8, sub, tma), *seg_tree.chunks_of(seg, cfg["BK"]))


def _source(value, links):
    """The SSA value ``value`` names once its waits and layout conversions (``links``: result -> operand) are
    followed back."""
    value = value.split("#")[0]
    while value in links:
        value = links[value]
    return value


def _tree_as_written(kernel, nch, tail):
    for ir in ("ttir", "ttgir"):
        text = kernel.asm[ir]
        zero = set(re.findall(r"(%[\w.]+) = arith\.constant dense<0\.000000e\+00> : tensor<\d+x\d+xf32", text))
        # a warp-group MMA's result passes through its wait, and (where a tail chunk's MMA takes another layout)
        # a layout conversion, which moves values between registers without arithmetic
        waited = dict(re.findall(r"(%[\w.]+):\d+ = ttng\.warp_group_dot_wait (%[\w.]+)", text))
        waited.update((r, v.split("#")[0]) for r, v in re.findall(r"(%[\w.]+) = ttg\.convert_layout (%[\w.#]+)", text))
        dots = re.findall(r"(%[\w.]+) = (?:tt\.dot|ttng\.warp_group_dot) %[\w.#]+, %[\w.#]+, (%[\w.#]+)", text)
        assert len(dots) == nch + bool(tail), (ir, dots)
        prev = None  # the segment's previous MMA; its first accumulates into the zero tile
        for res, acc in dots:
            assert _source(acc, waited) in zero if prev is None else _source(acc, waited) == prev, (ir, "an MMA accumulates into", acc)
            prev = res
        adds = re.findall(r"= arith\.addf (%[\w.#]+), (%[\w.#]+) : tensor<\d+x\d+xf32", text)
        assert len(adds) == 3, (ir, adds)
        assert _source(adds[0][1], waited) == prev, (ir, "the fold's first addition", adds)


# the start-up choice's candidates at the segments of 8 of h1536e256k6, 30B-A3B, h3072e64k4, 235B-A22B and
# Coder-480B-A35B (at the stages that fit), and at 2048 / 8, by pointer loads; by descriptor too at 235B-A22B's and
# Coder-480B-A35B's, the most shared memory
CHOICE_TILES = [(seg, cfg, tma) for seg in (64, 96, 128, 192, 256, 320) for cfg in mm.tree_candidates(seg)
                for tma in ((False, True) if seg in (192, 320) else (False,))]


@pytest.mark.parametrize("seg,cfg,tma", CHOICE_TILES, ids=[f"seg{s}-{c['BLOCK_M']}x{c['BLOCK_N']}w{c['num_warps']}"
                                                           f"{'-tma' if t else ''}" for s, c, t in CHOICE_TILES])
def test_the_tree_tile_candidates_compile_within_a_block_s_shared_memory(compile_facts, seg, cfg, tma):
    """Every candidate of the tree down projection's start-up choice (``matmul.tree_candidates``: those whose
    stages ``seg_tree.fits_block`` admits) compiles for sm_90a at the real segment widths without a spill, in the
    227 KB of shared memory an H100 or H200 block has (128 x 64 at 235B-A22B's 192 columns stages over
    ``seg_tree.SMEM_BUDGET``; at 320 columns ROW_SEG's 2 stages take 200 KB), in the rollout's order of programs,
    with the tree's arithmetic as written."""
    from true_on_policy.kernels import seg_tree

    kernel = compile_facts.seg_tree_kernel(cfg, seg, 8, 1, tma, group=mm.MOE_GROUP_M)
    got = compile_facts.facts(kernel)
    assert got["spill_store_bytes"] == 0 and got["shared_bytes"] <= seg_tree.BLOCK_SMEM, got
    assert got["HGMMA" if cfg["BLOCK_M"] >= 64 else "HMMA"] > 0, got
    _tree_as_written(kernel, *seg_tree.chunks_of(seg, cfg["BK"]))


def test_the_committed_wide_tile_facts_are_what_this_checkout_compiles(compile_facts):
    """The row docs/throughput.md#v1 leans on for tiles beyond the candidates: a3b48's down projection at
    128 x 128 in 16 warps, the weights by descriptor (the form that spills least)."""
    doc = json.loads((ROOT / "evidence" / "compile-seg-tree-wide.json").read_text())
    assert doc["tiles"] == "wide"
    row = next(r for r in doc["rows"] if r["geometry"] == "a3b48" and r["tile"]["num_warps"] == 16
               and (r["tile"]["BLOCK_M"], r["tile"]["BLOCK_N"], r["tile"]["BK"]) == (128, 128, 64))
    assert row["tile"] in compile_facts.WIDE
    got = compile_facts.facts(compile_facts.seg_tree_kernel(row["tile"], row["segment"], row["segments"],
                                                            row["subtiles"], True))
    assert got == row["tma"], (got, row["tma"])


def test_the_grouped_gemms_compile_alike_in_every_order(compile_facts):
    """The MoE's grouped GEMMs above the decode path compile for sm_90a with the same MMA, copy, select and
    add instructions and the same shared memory, without a spill, whether their programs run in groups of
    MOE_GROUP_M M blocks (``matmul.program_tile``) or in the 2-D grid's column order: the order changes only
    which program computes a tile. Every tile of the rule's tables at the 235B-A22B layer (gate/up, bf16
    out; the flat down projection, fp32 out) and v1's tree down projection (ROW_SEG, both weight fetches). The start-up
    choice's other candidates are not alike: at some segments and orders the compiler unrolls the segment loop (the GPU tier checks
    their bits in every order: test_program_order_changes_no_bit)."""

    forms = [(compile_facts.grouped_tma_kernel, (cfg, 3072, 4096, "bf16")) for cfg in mm.table_tiles(mm.GROUPED_UP_ROWS)]
    forms += [(compile_facts.grouped_tma_kernel, (cfg, 4096, 1536, "fp32")) for cfg in mm.table_tiles(mm.DOWN_TMA)]
    forms += [(compile_facts.seg_tree_kernel, (mm.ROW_SEG, 192, 8, 1, tma)) for tma in (False, True)]
    for make, args in forms:
        columns, grouped = (compile_facts.facts(make(*args, group=g)) for g in (0, mm.MOE_GROUP_M))
        assert columns["spill_store_bytes"] == grouped["spill_store_bytes"] == 0, (args, columns, grouped)
        for key in ("HMMA", "HGMMA", "LDGSTS", "FSEL", "FADD", "shared_bytes"):
            assert columns[key] == grouped[key], (args, key, columns, grouped)


def test_the_wide_segments_decode_tiles_compile_within_a_block_s_shared_memory(compile_facts):
    """Where Coder-480B-A35B's 320-column segments are too wide for ROW_SEG's stages, each decode tile its down
    projection takes at decode token counts (``matmul.wide_decode``, ``seg_tiles``; 1 to 160 tokens) compiles for
    sm_90a in its block loop without a spill, within a block's shared memory, with the tree's arithmetic as written."""
    from true_on_policy.kernels import seg_tree

    tiles = []
    for tokens in range(1, 161):
        cfg = mm.seg_tiles(tokens, tokens * 8, 160, 6144, 2560, 8, 132)
        if cfg not in tiles:
            tiles.append(cfg)
    assert all(seg_tree.smem_ok(320, c) for c in tiles) and not seg_tree.smem_ok(320, mm.ROW_SEG), tiles
    for cfg in tiles:
        kernel = compile_facts.seg_tree_kernel(cfg, 320, 8, mm.ALIGN // cfg["BLOCK_M"], False)
        got = compile_facts.facts(kernel)
        assert got["spill_store_bytes"] == 0 and got["shared_bytes"] <= seg_tree.BLOCK_SMEM, (cfg, got)
        assert got["HGMMA" if cfg["BLOCK_M"] >= 64 else "HMMA"] > 0, (cfg, got)
        _tree_as_written(kernel, *seg_tree.chunks_of(320, cfg["BK"]))


SMEM_FORMS = [(96, dict(BLOCK_M=128, BLOCK_N=128, BK=32, num_warps=8, STAGES=5)),
              (192, dict(BLOCK_M=128, BLOCK_N=128, BK=64, num_warps=8, STAGES=3)),
              (64, dict(BLOCK_M=64, BLOCK_N=128, BK=32, num_warps=4, STAGES=6)),
              (96, dict(BLOCK_M=128, BLOCK_N=128, BK=32, num_warps=8, STAGES=5, PINGPONG=True)),
              (192, dict(BLOCK_M=128, BLOCK_N=128, BK=32, num_warps=8, STAGES=5, PINGPONG=True, TMA_B=True))]


@pytest.mark.parametrize("seg,cfg", SMEM_FORMS, ids=[f"seg{s}-{c['BLOCK_M']}x{c['BLOCK_N']}k{c['BK']}{'-pingpong' if c.get('PINGPONG') else ''}"
                                              f"{'-tma' if c.get('TMA_B') else ''}"
                                              for s, c in SMEM_FORMS])
def test_the_shared_memory_tree_compiles_without_a_spill_each_segment_from_zero(compile_facts, seg, cfg):
    """``seg_tree_smem`` (the tree's waiting partials in shared memory) compiles for sm_90a without a spill, within
    a block's shared memory, with one accumulator and with two (PINGPONG), the weights by ``cp.async`` and by TMA
    (TMA_B: one bulk tensor copy a chunk): each segment's warp-group MMAs in order,
    the first of each from zero (``useC`` false), one MMA step per 16 columns of K, and the fold's seven additions
    per output element (8 segments)."""
    from true_on_policy.kernels import seg_tree, seg_tree_smem

    kernel = compile_facts.seg_tree_smem_kernel(cfg, seg, 8, group=mm.MOE_GROUP_M)
    got = compile_facts.facts(kernel)
    assert got["spill_store_bytes"] == 0 and got["shared_bytes"] <= seg_tree.BLOCK_SMEM, got
    assert got["shared_bytes"] >= seg_tree_smem.smem_bytes(cfg), got
    assert got["HGMMA"] == 8 * seg // 16, got  # each warp group runs every 16-column step of its 64 rows
    assert got["FADD"] == 7 * cfg["BLOCK_M"] * cfg["BLOCK_N"] // (32 * cfg["num_warps"]), got
    flags = re.findall(r"ttng\.warp_group_dot %[\w.#]+, %[\w.#]+, %[\w.#]+, (%\w+)", kernel.asm["ttgir"])
    per = seg // cfg["BK"]
    assert len(flags) == 8 * per, flags
    assert [f == "%false" for f in flags] == [i % per == 0 for i in range(8 * per)], flags
    assert kernel.asm["ptx"].count("cp.async.bulk.tensor") == (8 * per if cfg.get("TMA_B") else 0)
