"""Interpreted (TRITON_INTERPRET=1, 16-wide fp32 rounding steps: ``matmul.interpreted_dot``): the
two-segment TMA forms of tree width 2 (o_proj: ``_launch_tma(segments=2)``; the MoE down projection:
``grouped_tma.launch(segments=2)``) compute s0 + s1, each half one 16-step K loop from zero, for every
tile the launchers can give them (``halves_tile`` of the "row" tiles, DOWN2_TMA and the grouped decode
tiles, with and without the block loop), batch-invariantly; each half is what the plain (1-segment)
form computes over that half alone, so a TP-2 rank's root plus its sibling's is the whole; at width 2
the MoE block and row_linear as the CPU runs them (the pointer tree) are close to their width-2
references, batch-invariant, and not width 8's bits; the launchers' dispatch (TMA taken as on Hopper)
takes the two-segment form where a tile divides K / 2; bad arguments are refused."""
import sys

import torch

sys.path.insert(0, "tests")  # run with the checkout as cwd (see test_kernels_interpret.py)
from helpers import expect_value_errors  # noqa: E402
from true_on_policy.kernels import grouped_tma  # noqa: E402
from true_on_policy.kernels import matmul as mm  # noqa: E402
from true_on_policy.kernels.moe import align  # noqa: E402

g = torch.Generator().manual_seed(2)


def ref16(x, w):  # one fp32 accumulator from zero, 16-wide steps of exact products from k = 0 upward
    acc = torch.zeros(x.shape[0], w.shape[0])
    for s in range(0, x.shape[1], 16):
        acc = acc + (x[:, s:s + 16].double() @ w[:, s:s + 16].double().T).float()
    return acc


def ref_halves(x, w):  # the 2-segment tree: s0 + s1, one fp32 addition
    h = x.shape[1] // 2
    return ref16(x[:, :h], w[:, :h]) + ref16(x[:, h:], w[:, h:])


# o_proj: the "row" tiles (decode rule and table), K / 2 = 192 (a multiple of 64, not of 128 or 256)
N, K = 80, 384
x = torch.randn(70, K, generator=g).bfloat16()
w = (torch.randn(N, K, generator=g) * 0.05).bfloat16()
full = ref_halves(x, w)
assert not torch.equal(full, ref16(x, w))  # the tree is not the plain loop: the test can tell them apart
tiles = {mm.halves_tile(mm.tma_tiles("row", m, N, K, 132), K)["BLOCK_K"] for m in (1, 16, 64, 300)}
assert tiles == {64}, tiles  # BLOCK_K 128 / 256 of the rule cut to the widest that divides K / 2
cfgs = [mm.halves_tile(c, K) for c in mm.candidate_tiles("row")]
assert all(c is not None and (K // 2) % c["BLOCK_K"] == 0 for c in cfgs)
for cfg in cfgs[::7] + mm.table_tiles(mm.ROW_TMA):
    cfg = mm.halves_tile(cfg, K)
    for m in (1, 3, 70):
        out = mm._launch_tma(x[:m].clone(), w, torch.empty(m, N), cfg, dot_step=16, segments=2)
        assert torch.equal(out, full[:m]), ("row", cfg, m, (out - full[:m]).abs().max().item())
# a TP-2 rank's plain loop over its half is that half's root; the two roots in rank order are the tree
h = K // 2
cfg = mm.halves_tile(mm.by_rows(mm.ROW_TMA, 70), K)
roots = [mm._launch_tma(x[:, r * h:(r + 1) * h].contiguous(), w[:, r * h:(r + 1) * h].contiguous(),
                        torch.empty(70, N), cfg, dot_step=16) for r in range(2)]
assert torch.equal(roots[0] + roots[1], full)

# the MoE down projection: rows gathered through the expert table, per-expert weights, K / 2 = 128
E, NG, KG = 6, 40, 256
xg = torch.randn(130, KG, generator=g).bfloat16()
w2 = (torch.randn(E, NG, KG, generator=g) * 0.05).bfloat16()
down_tiles = mm.table_tiles(mm.DOWN2_TMA) + [mm.DECODE_GRID[16, 64, 64], mm.DECODE_GRID[64, 128, 64]]
for t, k, e in ((1, 2, E), (9, 3, E), (130, 1, 1)):
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).int()
    rows, be, _, _ = align(ids, 0, e)
    we = w2[:e].contiguous()
    used = (be >= 0).repeat_interleave(mm.ALIGN) & (rows >= 0)
    ref = torch.full((rows.shape[0], NG), float("nan"))
    for p in used.nonzero()[:, 0].tolist():
        ref[p] = ref_halves(xg[rows[p]:rows[p] + 1], we[be[p // mm.ALIGN]])[0]
    for cfg in down_tiles:
        cfg = mm.halves_tile(cfg, KG)
        for sub in (1, mm.ALIGN // cfg["BLOCK_M"]):  # one tile per program, or the block loop over the trimmed table
            count = rows.shape[0] if sub == 1 else mm.used_blocks(t * k, e) * mm.ALIGN
            b = be.repeat_interleave(mm.ALIGN // (cfg["BLOCK_M"] * sub))
            out = grouped_tma.launch(xg, we, torch.full((rows.shape[0], NG), float("nan")), rows, b, count, cfg,
                                     dot_step=16, subtiles=sub, segments=2)
            assert torch.equal(out[used], ref[used]), ("down", cfg, sub, t, k, e)
            # each half alone through the plain (1-segment) form: an expert-TP-2 rank's root
            halves = [grouped_tma.launch(xg[:, r * 128:(r + 1) * 128].contiguous(),
                                         we[:, :, r * 128:(r + 1) * 128].contiguous(),
                                         torch.empty(rows.shape[0], NG), rows, b, count, cfg, dot_step=16, subtiles=sub)
                      for r in range(2)]
            assert torch.equal((halves[0] + halves[1])[used], ref[used]), ("down halves", cfg, sub, t)

# the block at width 2 through the launchers as the CPU runs them (no TMA: the pointer kernels' 2-segment tree):
# close to its width-2 reference, batch-invariant, and the width reaches the down projection (its bits differ
# from width 8's); row_linear likewise
from helpers import random_moe  # noqa: E402
from true_on_policy.kernels.moe import expert_outputs, moe, moe_reference  # noqa: E402
from true_on_policy.kernels.tree_reduce import row_linear, row_linear_reference, set_tree_width  # noqa: E402

xm, router, w13, wd = random_moe(g, 13, 8, 64, 128, router_scale=0.1, weight_scale=0.05)
with set_tree_width(2):
    y = moe(xm, router, w13, wd, 2)
    torch.testing.assert_close(y.float(), moe_reference(xm, router, w13, wd, 2, acc=torch.float64).float(),
                               rtol=2e-2, atol=2e-2)
    for n in (1, 5, 12):
        assert torch.equal(moe(xm[:n].clone(), router, w13, wd, 2), y[:n]), n
    yr = row_linear(x, w, out_dtype=torch.float32)
    torch.testing.assert_close(yr, row_linear_reference(x, w, torch.float32), rtol=1e-5, atol=1e-5)
    for n in (1, 7, 33):
        assert torch.equal(row_linear(x[:n].clone(), w, out_dtype=torch.float32), yr[:n]), n
assert torch.equal(row_linear(x, w, out_dtype=torch.float32, width=2), yr)
assert not torch.equal(row_linear(x, w, out_dtype=torch.float32, width=8), yr)  # the width reaches the kernels
ids2 = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(13)]).int()
assert not torch.equal(expert_outputs(xm, ids2, w13, wd, 0, 2, width=2), expert_outputs(xm, ids2, w13, wd, 0, 8, width=8))

# the launchers' dispatch with TMA taken as on Hopper: width 2's forms where a tile divides K / 2
grouped_tma.usable = lambda x, w: True
mm.hopper = lambda x: True
mm.sm_count = lambda x: 132
for t in (1, 9, 40, 300):
    xm = x[:t].clone() if t <= 70 else torch.randn(t, K, generator=g).bfloat16()
    got = mm.matmul(xm, w, torch.float32, segments=2, tree=True, role="row")
    assert torch.equal(got, mm._launch_tma(xm, w, torch.empty(t, N), mm.halves_tile(
        mm.tma_tiles("row", t, N, K, 132), K), segments=2)), ("row dispatch", t)
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(min(t, 130))]).int()
    rows, be, _, own = align(ids, 0, E)
    xd = xg[:ids.shape[0]].clone()
    used = (be >= 0).repeat_interleave(mm.ALIGN) & (rows >= 0)
    cfg = mm.halves_tile(mm.grouped_tiles("tree2", ids.shape[0], 2 * ids.shape[0], E, NG, KG, 132), KG)
    got = mm.grouped_matmul(xd, w2, rows, be, torch.float32, 2, tree=True, role="tree2", tokens=ids.shape[0],
                            slots=2 * ids.shape[0])
    b = be.repeat_interleave(mm.ALIGN // cfg["BLOCK_M"])
    want = grouped_tma.launch(xd, w2, torch.empty_like(got), rows, b, rows.shape[0], cfg, segments=2)
    assert torch.equal(got[used], want[used]), ("down dispatch", t, cfg)
# K / 2 not a multiple of 64: no tile; the launchers keep the pointer kernels' tree forms
assert mm.halves_tile(mm.by_rows(mm.ROW_TMA, 300), 2 * 40) is None and mm.halves_tile(mm.DECODE_GRID[16, 64, 64], 7) is None
x40, w40 = torch.randn(3, 80, generator=g).bfloat16(), (torch.randn(N, 80, generator=g) * 0.05).bfloat16()
assert torch.equal(mm.matmul(x40, w40, torch.float32, segments=2, tree=True, role="row"),
                   mm._launch(x40, w40, torch.empty(3, N), None, None, 3, 2, mm.tree_tiles(mm.ROW, 3, N, 80, 132)))
# refused: a chunk across the halves, 3 segments, the GLU form with 2, the tree2 role without the 2-segment tree
c128 = dict(mm.DECODE_GRID[16, 64, 128])
expect_value_errors(
    lambda: mm._launch_tma(x, w, torch.empty(70, N), c128, segments=2),
    lambda: mm._launch_tma(x, w, torch.empty(70, N), mm.halves_tile(c128, K), segments=3),
    lambda: grouped_tma.launch(xg[:, :192].contiguous(), w2[:, :, :192].contiguous(), torch.empty(rows.shape[0], NG),
                               rows, be, rows.shape[0], mm.DECODE_GRID[16, 64, 64], segments=2),  # 96 = 64 + 32
    lambda: grouped_tma.launch(xg, w2, torch.empty(rows.shape[0], NG // 2), rows, be, rows.shape[0],
                               mm.halves_tile(c128, KG), glu=True, segments=2),
    lambda: mm.grouped_matmul(xg, w2, rows, be, torch.float32, 8, tree=True, role="tree2", tokens=4, slots=8),
    lambda: mm.grouped_matmul(xg, w2, rows, be, torch.float32, 2, tree=True, role="tree2"))
print("interpreted-ok")
