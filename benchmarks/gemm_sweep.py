"""Kernel forms and tiles for every GEMM of a Qwen3-30B-A3B layer, and for the glue kernels the
prefill profile names (QK-norm, the MoE table and combine): time of each candidate and whether it
computes the bits of the form the rollout runs today (speed decides only among candidates with
the same bits).

    PYTHONPATH=.:$PYTHONPATH python benchmarks/gemm_sweep.py [--tokens 1 64 256 4096] \\
        [--gemms down down_flat down_w2 gate_up o_proj o_proj_flat o_proj_w2 qkv router lm_head qk_norm align combine] \\
        [--copies 1] \\
        [--dense-geometry NAME] [--moe-geometry NAME] [--out X.json]

Inputs as the rollout sees them (random bf16, never zeros): T tokens routed at random over 128
experts, top-8, through ``moe.align``. GEMMs and their reference (first) form:

- down: h [P, 768] @ w2 [128, 2048, 768], 8-segment tree, fp32 out; reference ROW_FLAT
  (``_tree_dot_flat``); candidates: ``seg_tree`` (the segments as the pipelined loop), with the weights by
  pointer loads and by tensor descriptor (``seg_tree_tma``), and the rollout's call (``grouped_matmul`` with
  the token count: the decode tiles, above them the tile ``choose_tree_tiles`` timed for the shape, as a server's
  start-up does) with ``SEG_TMA`` off and on and under ``TREE_FIXED`` (ROW_SEG above the decode path), and
  ROW_SEG with its programs in each order (``ORDERS``: groups of 1 to 16 M blocks, ``matmul.program_tile``, or 0,
  the column order), and ``seg_tree_smem`` (the tree's waiting partials in shared memory, Gluon) at ``SMEM``'s
  tiles whose chunks split the segment. ``--forms`` keeps only the named forms beside the reference. Every other
  MoE candidate tile runs its programs in the rollout's order above the decode path (``matmul.MOE_GROUP_M`` M
  blocks a group, named in its row).
- down_flat: the same GEMM at tree width 1 (the flat contract): one plain grouped GEMM, fp32 out;
  reference ``grouped_matmul(tree=False)`` (the gate/up TMA tiles); candidates: the rollout's call (role "down"
  with the token count and slots: ``moe_tile``'s tile above the decode path), that tile in each order of its
  programs (``ORDERS``), other TMA tiles.
- down_w2: the same GEMM at tree width 2 (``qwen3_moe_true_on_policy_w2_preview_v1``): reference the pointer
  kernels' 2-segment tree (``grouped_matmul(segments=2, tree=True)``); candidates: the rollout's call
  (``role="tree2"``) and the two-segment TMA form (``grouped_tma.launch(segments=2)``) at DOWN2_TMA's and the
  gate/up TMA tiles (``matmul.halves_tile``).
- gate_up: x [T, 2048] @ w13 [128, 1536, 2048]; reference GROUPED_UP; candidates: the rollout's call (with the
  token count and slots), the rule's tile in each order of its programs (``ORDERS``), weights by TMA
  (``grouped_tma``), other pointer tiles.
- o_proj: [T, 4096] @ [2048, 4096] (or ``--dense-geometry``'s), 8-segment tree, bf16 out; reference ``row_linear``
  (``split_matmul`` planes + ``_tree_kernel``, the rollout's call); candidates: ``seg_tree``, ``ROW_FLAT``, the planes
  of 1, 2 or 4 segments a program.
- qkv [T, 2048] @ [5120, 2048], router [T, 2048] @ [128, 2048] and o_proj_flat [T, 4096] @
  [2048, 4096] (o_proj at tree width 1: one plain GEMM): reference ``matmul`` with the role the
  rollout passes ("plain", "router", "row"); candidates: other TMA tiles, the decode grid's 16-row
  tiles, and those with deeper pipelines (``DEEP``: 6 to 12 stages of
  64- or 128-wide K chunks, 4 to 8 of 256). ``--copies N`` times
  these three over N copies of the weight, one after the other (a row's time is the total over
  N divided by N), so that the weights come from HBM as in the model's layer stack, not from the 50 MB L2.
  ``--dense-geometry NAME`` takes these three GEMMs' shapes from a geometry of ``benchmarks/geometries.py``,
  ``--moe-geometry NAME`` the MoE's (down, down_flat, gate_up: experts, top-k, hidden, moe_intermediate).
- o_proj_w2: o_proj at tree width 2 (its shape from ``--dense-geometry``): reference ``split_matmul(segments=2)``;
  candidates: the rollout's ``row_linear(width=2)`` and the two-segment TMA form at ROW_TMA's and DENSE's tiles.
- o_proj also tries matmul's ROW_FLAT form (the tree folded inside one pipelined K loop, no fp32 planes) at several tiles,
  and planes of 2- or 4-segment subtrees (``split_matmul(per_plane=...)``: half or a quarter of
  the planes written and read back).
- lm_head: [T, 2048] @ [151936, 2048], fp32 out; reference ``matmul(role="lm_head")``; candidates:
  every tile of the decode grid (``matmul.DECODE_GRID``), and cuBLAS (bf16 out, stock's) for scale.
- qk_norm: ``rmsnorm_heads`` over the 32 query heads of 128 in a fused qkv row: the tile form
  (TILE_ROWS head-rows per program), timed alone (its tile is fixed: another tile is other bits).
- align: the expert table (``moe.align``: one launch up to ``moe.NBLOCK`` slots, a count and a
  placement launch above, each program scanning the slots); reference ``moe.NBLOCK`` slots per step;
  candidates: other steps (``nblock``). The time includes one concatenation of the four outputs, the
  same for every row.
- combine: the MoE combine of 8 fp32 slots into 2048 bf16 columns; reference ``moe.HBLOCK``
  columns per program; candidates: other widths (``hblock``).

Each row: median ms of CUDA-graph replays (``triton.testing.do_bench_cudagraph``), the weight
bytes read over that time (the touched experts' for the MoE; for the glue kernels the bytes they
read and write; GB/s against the H200's ~4.3 TB/s), and ``torch.equal`` with the reference on
every real row. A candidate that fails to
compile or launch is reported, not fatal.
"""

from __future__ import annotations

import argparse

import torch
import triton

E, K_TOP, H, INTER, QKV, O_IN, HQ, D = 128, 8, 2048, 768, 5120, 4096, 32, 128
VOCAB = 151936

SEG = [dict(BLOCK_M=16, BLOCK_N=64, BK=32, num_warps=4, num_stages=3),
       dict(BLOCK_M=16, BLOCK_N=64, BK=64, num_warps=4, num_stages=3),
       dict(BLOCK_M=16, BLOCK_N=128, BK=64, num_warps=4, num_stages=3),
       dict(BLOCK_M=32, BLOCK_N=64, BK=64, num_warps=4, num_stages=3),
       dict(BLOCK_M=32, BLOCK_N=128, BK=64, num_warps=4, num_stages=3),
       dict(BLOCK_M=64, BLOCK_N=64, BK=64, num_warps=4, num_stages=3),
       dict(BLOCK_M=64, BLOCK_N=64, BK=32, num_warps=4, num_stages=4),
       dict(BLOCK_M=64, BLOCK_N=128, BK=64, num_warps=8, num_stages=3),
       dict(BLOCK_M=64, BLOCK_N=128, BK=64, num_warps=8, num_stages=2),  # 64 x 128 in 8 warps where 3 stages overfill
       dict(BLOCK_M=128, BLOCK_N=64, BK=64, num_warps=8, num_stages=3),
       dict(BLOCK_M=128, BLOCK_N=64, BK=64, num_warps=8, num_stages=4),  # 4 stages where a segment is narrow
       dict(BLOCK_M=64, BLOCK_N=32, BK=64, num_warps=4, num_stages=3),  # 32 columns: in groups of M blocks (the
       dict(BLOCK_M=128, BLOCK_N=32, BK=64, num_warps=4, num_stages=3),  # rollout's order) a group's activation
       dict(BLOCK_M=128, BLOCK_N=32, BK=64, num_warps=8, num_stages=3),  # rows serve every N tile from L2
       dict(BLOCK_M=128, BLOCK_N=128, BK=64, num_warps=8, num_stages=2),
       dict(BLOCK_M=128, BLOCK_N=128, BK=64, num_warps=16, num_stages=2),  # 16 warps: at most 128 registers a thread
       dict(BLOCK_M=128, BLOCK_N=128, BK=32, num_warps=16, num_stages=3)]
# seg_tree_smem's tiles (the tree's waiting partials in shared memory): the tree down projection's, beside SEG's
SMEM = [dict(BLOCK_M=128, BLOCK_N=128, BK=32, num_warps=8, STAGES=5),
        dict(BLOCK_M=128, BLOCK_N=128, BK=64, num_warps=8, STAGES=3),
        dict(BLOCK_M=64, BLOCK_N=128, BK=32, num_warps=4, STAGES=6),
        dict(BLOCK_M=128, BLOCK_N=128, BK=32, num_warps=8, STAGES=5, PINGPONG=True),  # two accumulators: a segment
        dict(BLOCK_M=64, BLOCK_N=128, BK=32, num_warps=4, STAGES=6, PINGPONG=True),  # folds while the next multiplies
        dict(BLOCK_M=128, BLOCK_N=128, BK=32, num_warps=8, STAGES=5, TMA_B=True),  # the weights by TMA
        dict(BLOCK_M=128, BLOCK_N=128, BK=32, num_warps=8, STAGES=5, PINGPONG=True, TMA_B=True)]
UP_TMA = [dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4),
          dict(BLOCK_M=32, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4),
          dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4),
          dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=3),
          dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3),
          dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4),
          dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3),
          dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4),
          dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4)]
DENSE = [dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4),
         dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4),
         dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=4),
         dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4),
         dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, num_warps=8, num_stages=4),
         dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=4),
         dict(BLOCK_M=64, BLOCK_N=16, BLOCK_K=256, num_warps=4, num_stages=3),
         dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=4),
         dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=6),
         dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=3),
         dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3),
         dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=128, num_warps=8, num_stages=3),
         dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4),
         dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3)]
# decode-grid shapes with deeper pipelines (more of a program's K loop in flight; num_stages sets only how far
# ahead operands are fetched, so the same bits): candidates for the few-row GEMMs, which wait on HBM latency
DEEP = [dict(BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, num_warps=4, num_stages=st) for bn in (16, 32, 64)
        for bk, st in ((64, 6), (64, 8), (128, 6), (128, 8), (128, 12), (256, 4), (256, 6), (256, 8))]
ROLE = {"qkv": "plain", "router": "router", "o_proj_flat": "row"}  # the role the rollout passes
FLAT = [dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=4, N_GROUP=4, FLAT=True),  # ROW_FLAT
        dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=4, N_GROUP=1, FLAT=True),
        dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=4, N_GROUP=2, FLAT=True),
        dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3, N_GROUP=1, FLAT=True),
        dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, num_warps=8, num_stages=3, N_GROUP=1, FLAT=True)]
# o_proj planes (split_matmul): the partial GEMM's tiles, ROW (the reference's) first
PLANE_TILES = [dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3),
               dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3),
               dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4)]
ORDERS = [0, 1, 4, 8, 16]  # M blocks per group of programs (matmul.program_tile); 0: the 2-D grid's column order
HBLOCKS = [256, 1024]  # combine: columns per program (the default, moe.HBLOCK, is the reference)
NBLOCKS = [1024, 4096]  # align: slots scanned per step (the default, moe.NBLOCK, is the reference)


def _tag(form, cfg):
    if "per_plane" in cfg:
        return f"{form} per_plane {cfg['per_plane']} " + _tag("", {k: v for k, v in cfg.items() if k != "per_plane"})[1:]
    if "rows" in cfg or "hblock" in cfg or "nblock" in cfg or "SEG_TMA" in cfg:
        return f"{form} " + ", ".join(f"{k} {v}" for k, v in cfg.items())
    keys = [k for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "BK") if k in cfg]
    extra = f" g{cfg['N_GROUP']}" if cfg.get("N_GROUP", 1) > 1 else ""
    extra += f" group {cfg['group']}" if "group" in cfg else ""
    return f"{form} " + "x".join(str(cfg[k]) for k in keys) + f" w{cfg['num_warps']} s{cfg['num_stages']}{extra}"


def _time(fn):
    fn()
    with torch.cuda.stream(torch.cuda.Stream()):
        return triton.testing.do_bench_cudagraph(fn, rep=60, return_mode="median")


def _cases(gemm, t, g, w, mm, moe):
    """(reference, [candidates]) for one GEMM at t tokens; each a (name, cfg, fn -> out, mask)."""
    import true_on_policy.kernels.grouped_tma as gt
    import true_on_policy.kernels.seg_tree as st
    from true_on_policy.kernels.tree_reduce import row_linear

    if gemm in ("down", "down_flat", "down_w2", "gate_up"):  # the MoE's shape: ``moe_shape`` of --moe-geometry
        e, top, hid, inter = (w["moe"][k] for k in ("experts", "top_k", "hidden", "inter"))
        ids = torch.rand(t, e, device="cuda", generator=g).argsort(dim=1)[:, :top].int()
        rows, be, _, own = moe.align(ids, 0, e)
        used = (be >= 0).repeat_interleave(mm.ALIGN)

        def bexp(bm):
            per = mm.ALIGN // bm
            return be[:, None].expand(-1, per).reshape(-1).contiguous() if per > 1 else be
        touched = int(torch.unique(ids).numel())
        order = mm.moe_group()  # the rollout's order above the decode path
    if gemm == "down":
        h = torch.randn(rows.shape[0], inter, device="cuda", generator=g).bfloat16()
        mask, n = used & (own >= 0), hid
        if (inter // 8, hid, e) not in mm.TREE_CHOSEN:  # the server's start-up choice for the shape, made once
            mm.choose_tree_tiles(w["w2"], 8)

        def ref():
            return mm.grouped_matmul(h, w["w2"], own, be, torch.float32, 8, tree=True)

        def seg(cfg, tma=False):  # in the rollout's order of programs
            out = torch.empty(rows.shape[0], n, dtype=torch.float32, device="cuda")
            b = bexp(cfg["BLOCK_M"])
            return lambda: st.launch(h, w["w2"], out, own, b, rows.shape[0], 8, cfg, tma=tma, group=order)

        def rollout(tma, fixed=False):  # the MoE's call (decode tiles where grouped_decode holds, the choice above),
            def fn():  # SEG_TMA off and on; TREE_FIXED: ROW_SEG above the decode path
                old, mm.SEG_TMA, old_fixed, mm.TREE_FIXED = mm.SEG_TMA, tma, mm.TREE_FIXED, fixed
                try:
                    return mm.grouped_matmul(h, w["w2"], own, be, torch.float32, 8, tree=True, tokens=t, slots=t * top)
                finally:
                    mm.SEG_TMA, mm.TREE_FIXED = old, old_fixed
            return fn

        def ordered(grp):  # ROW_SEG (the tree's tile above the decode path) in groups of grp M blocks
            out = torch.empty(rows.shape[0], n, dtype=torch.float32, device="cuda")
            b = bexp(mm.ROW_SEG["BLOCK_M"])
            return lambda: st.launch(h, w["w2"], out, own, b, rows.shape[0], 8, mm.ROW_SEG, group=grp)

        def smem(cfg):  # the partials in shared memory (Gluon), in the rollout's order of programs
            import true_on_policy.kernels.seg_tree_smem as sm
            out = torch.empty(rows.shape[0], n, dtype=torch.float32, device="cuda")
            b = bexp(cfg["BLOCK_M"])
            return lambda: sm.launch(h, w["w2"], out, own, b, rows.shape[0], 8, cfg, group=order)
        fits = [c for c in SEG if st.fits(inter // 8, c["BK"])]
        cands = [("seg_tree", dict(c, group=order), seg(c)) for c in fits]
        cands += [("seg_tree_smem" + (" pingpong" if c.get("PINGPONG") else "") + (" tma" if c.get("TMA_B") else ""),
                   dict({k: v for k, v in c.items() if k not in ("PINGPONG", "TMA_B")}, num_stages=c["STAGES"],
                        group=order), smem(c))
                  for c in SMEM if (inter // 8) % c["BK"] == 0]
        cands += [("seg_tree_tma", dict(c, group=order), seg(c, True)) for c in fits]
        cands += [("seg_tree order", dict(mm.ROW_SEG, group=grp), ordered(grp)) for grp in ORDERS]
        cands += [("rollout", {"SEG_TMA": False}, rollout(False)), ("rollout", {"SEG_TMA": True}, rollout(True)),
                  ("rollout", {"SEG_TMA": False, "TREE_FIXED": True}, rollout(False, True))]
        return ref, cands, mask, touched * hid * inter * 2
    if gemm == "down_flat":  # tree width 1: the down projection as one plain grouped GEMM, fp32 out
        h = torch.randn(rows.shape[0], inter, device="cuda", generator=g).bfloat16()
        mask = used & (own >= 0)

        def ref():
            return mm.grouped_matmul(h, w["w2"], own, be, torch.float32, 1, tree=False)

        def tma(cfg, grp=0):
            out = torch.empty(rows.shape[0], hid, dtype=torch.float32, device="cuda")
            b = bexp(cfg["BLOCK_M"])
            return lambda: gt.launch(h, w["w2"], out, own, b, rows.shape[0], cfg, group=grp)
        rollout = ("grouped_matmul (the rollout's call)", {},
                   lambda: mm.grouped_matmul(h, w["w2"], own, be, torch.float32, 1, tree=False, role="down", tokens=t,
                                             slots=t * top))
        rule = mm.moe_tile("down", t, t * top, e)  # the rollout's tile in each order of its programs
        orders = [("grouped_tma order", dict(rule, group=grp), tma(rule, grp)) for grp in ORDERS]
        others = [("grouped_tma", dict(c, group=order), tma(c, order)) for c in UP_TMA]
        return ref, [rollout] + orders + others, mask, touched * hid * inter * 2
    if gemm == "down_w2":  # tree width 2: the two-segment TMA form against the pointer kernels' 2-segment tree
        h = torch.randn(rows.shape[0], inter, device="cuda", generator=g).bfloat16()
        mask, slots = used & (own >= 0), t * top

        def ref():
            return mm.grouped_matmul(h, w["w2"], own, be, torch.float32, 2, tree=True)

        def halves(cfg):
            out = torch.empty(rows.shape[0], hid, dtype=torch.float32, device="cuda")
            b = bexp(cfg["BLOCK_M"])
            return lambda: gt.launch(h, w["w2"], out, own, b, rows.shape[0], cfg, segments=2)
        tiles = [c for c in (mm.halves_tile(c, inter) for c in mm.table_tiles(mm.DOWN2_TMA) + UP_TMA) if c is not None]
        rollout = ("tree2 (the rollout's call)", {}, lambda: mm.grouped_matmul(
            h, w["w2"], own, be, torch.float32, 2, tree=True, role="tree2", tokens=t, slots=slots))
        return ref, [rollout] + [("halves", c, halves(c)) for c in tiles], mask, touched * hid * inter * 2
    if gemm == "gate_up":
        x = torch.randn(t, hid, device="cuda", generator=g).bfloat16()
        mask, n = used & (rows >= 0), 2 * inter

        def ref():
            return mm.grouped_matmul(x, w["w13"], rows, be)

        def tma(cfg, grp=0):
            out = torch.empty(rows.shape[0], n, dtype=torch.bfloat16, device="cuda")
            b = bexp(cfg["BLOCK_M"])
            return lambda: gt.launch(x, w["w13"], out, rows, b, rows.shape[0], cfg, group=grp)
        rollout = ("grouped_matmul (the rollout's call)", {},
                   lambda: mm.grouped_matmul(x, w["w13"], rows, be, tokens=t, slots=t * top))
        rule = mm.moe_tile("plain", t, t * top, e)  # the rollout's tile in each order of its programs
        orders = [("grouped_tma order", dict(rule, group=grp), tma(rule, grp)) for grp in ORDERS]
        others = [("grouped_tma", dict(c, group=order), tma(c, order)) for c in UP_TMA]
        return ref, [rollout] + orders + others, mask, touched * 2 * inter * hid * 2
    if gemm == "o_proj":
        n, k = w["o"].shape
        x = torch.randn(t, k, device="cuda", generator=g).bfloat16()

        def ref():
            return row_linear(x, w["o"])

        def seg(cfg):
            out = torch.empty(t, n, dtype=torch.bfloat16, device="cuda")
            return lambda: st.launch(x, w["o"], out, None, None, t, 8, cfg)

        def flat(cfg):  # the tree in one pipelined K loop (matmul's ROW_FLAT form), rounded as it stores
            out = torch.empty(t, n, dtype=torch.bfloat16, device="cuda")
            return lambda: mm._launch(x, w["o"], out, None, None, t, 8, cfg)
        cands = [("seg_tree", c, seg(c)) for c in SEG if st.fits(k // 8, c["BK"])]
        planes = [("planes", dict(c, per_plane=pp), lambda pp=pp, c=c: mm.split_matmul(x, w["o"], 8, per_plane=pp, cfg=c))
                  for pp in (1, 2, 4) for c in PLANE_TILES]
        return ref, cands + [("row_flat", c, flat(c)) for c in FLAT] + planes, None, n * k * 2
    if gemm == "o_proj_w2":  # tree width 2: the two-segment TMA form against split_matmul's 2-segment planes
        k = w["o"].shape[1]
        x = torch.randn(t, k, device="cuda", generator=g).bfloat16()

        def halves(cfg):
            out = torch.empty(t, w["o"].shape[0], dtype=torch.bfloat16, device="cuda")
            return lambda: mm._launch_tma(x, w["o"], out, cfg, segments=2)
        tiles = [c for c in (mm.halves_tile(c, k) for c in mm.table_tiles(mm.ROW_TMA) + DENSE) if c is not None]
        rollout = ("row_linear (the rollout's call)", {}, lambda: row_linear(x, w["o"], width=2))
        return (lambda: mm.split_matmul(x, w["o"], 2), [rollout] + [("halves", c, halves(c)) for c in tiles], None,
                w["o"].numel() * 2)
    if gemm == "qk_norm":
        from true_on_policy.kernels.rmsnorm import rmsnorm_heads

        fused = torch.randn(t, QKV, device="cuda", generator=g).bfloat16()
        q = fused[:, :HQ * D]  # a strided view, as the rollout normalises it
        wn = (1 + 0.1 * torch.randn(D, device="cuda", generator=g)).bfloat16()
        return lambda: rmsnorm_heads(q, wn, 1e-6), [], None, 2 * t * HQ * D * 2
    if gemm == "align":
        ids = torch.rand(t, E, device="cuda", generator=g).argsort(dim=1)[:, :K_TOP].int()

        def table(nb=None):  # static shapes only: CUDA-graph timed
            rows, be, pos, own = moe.align(ids, 0, E) if nb is None else moe.align(ids, 0, E, nblock=nb)
            return torch.cat([rows, be.long(), pos, own])
        _, be0, pos0, _ = moe.align(ids, 0, E)
        used = (be0 >= 0).repeat_interleave(mm.ALIGN)  # rows of unused blocks are undefined: not compared
        mask = torch.cat([used, torch.ones_like(be0, dtype=torch.bool), torch.ones_like(pos0, dtype=torch.bool), used])
        cands = [("align", {"nblock": nb}, lambda nb=nb: table(nb)) for nb in NBLOCKS]
        return table, cands, mask, t * K_TOP * 4 * (E + 1)
    if gemm == "combine":
        ids = torch.rand(t, E, device="cuda", generator=g).argsort(dim=1)[:, :K_TOP].int()
        rows, be, pos, own = moe.align(ids, 0, E)
        e_out = torch.randn(rows.shape[0], H, device="cuda", generator=g)  # fp32: the down tree's output
        wts = torch.rand(t, K_TOP, device="cuda", generator=g)
        p2 = pos.view(t, K_TOP)
        cands = [("combine", {"hblock": hb}, lambda hb=hb: moe.combine(e_out, p2, wts, hblock=hb)) for hb in HBLOCKS]
        return lambda: moe.combine(e_out, p2, wts), cands, None, t * K_TOP * H * 4 + t * H * 2
    if gemm == "lm_head":  # fp32 logits over the vocabulary; candidates: the decode grid's tiles
        x = torch.randn(t, H, device="cuda", generator=g).bfloat16()

        def tile(cfg):
            out = torch.empty(t, VOCAB, dtype=torch.float32, device="cuda")
            return lambda: mm._launch_tma(x, w["lm_head"], out, cfg)
        cands = [("tma", c, tile(c)) for c in mm.DECODE_GRID.values()]
        return (lambda: mm.matmul(x, w["lm_head"], torch.float32, role="lm_head"),
                cands + [("cuBLAS", {}, lambda: x @ w["lm_head"].T)], None, VOCAB * H * 2)
    key = {"qkv": "qkv", "router": "router", "o_proj_flat": "o"}[gemm]
    copies = w[key + "_copies"]
    n, k = copies[0].shape
    x = torch.randn(t, k, device="cuda", generator=g).bfloat16()
    role = ROLE[gemm]

    def ref():  # the last copy's output is compared; every copy is timed
        for wc in copies:
            y = mm.matmul(x, wc, role=role)
        return y

    def tma(cfg):
        out = torch.empty(t, n, dtype=torch.bfloat16, device="cuda")

        def run():
            for wc in copies:
                mm._launch_tma(x, wc, out, cfg)
            return out
        return run

    def cublas():  # stock's GEMM (torch.mm): timed for scale, other bits
        for wc in copies:
            y = x @ wc.T
        return y
    grid = [c for c in mm.DECODE_GRID.values() if c["BLOCK_M"] == 16]
    return ref, [("tma", c, tma(c)) for c in DENSE + grid + DEEP] + [("cuBLAS", {}, cublas)], None, n * k * 2


def dense_shapes(geometry: str | None) -> dict:
    """[N, K] of the dense GEMMs (qkv, o_proj, router) of one layer of ``geometry`` (a name
    ``benchmarks/geometries.py`` knows), or of 30B-A3B's layer."""
    if geometry is None:
        return {"qkv": (QKV, H), "o": (H, O_IN), "router": (E, H)}
    from geometries import spec

    s = spec(geometry)
    h, d = s["hidden_size"], s["head_dim"]
    q, kv = s["num_attention_heads"] * d, s["num_key_value_heads"] * d
    return {"qkv": (q + 2 * kv, h), "o": (h, q), "router": (s["num_experts"], h)}


def moe_shape(geometry: str | None) -> dict:
    """The MoE of one layer of ``geometry`` (a name ``benchmarks/geometries.py`` knows), or of 30B-A3B's
    layer: experts, top-k, hidden size and moe_intermediate."""
    if geometry is None:
        return {"experts": E, "top_k": K_TOP, "hidden": H, "inter": INTER}
    from geometries import spec

    s = spec(geometry)
    return {"experts": s["num_experts"], "top_k": s["num_experts_per_tok"], "hidden": s["hidden_size"],
            "inter": s["moe_intermediate_size"]}


def run(tokens, gemms, copies=1, dense_geometry=None, moe_geometry=None, forms=None):
    import true_on_policy.kernels.matmul as mm
    import true_on_policy.kernels.moe as moe

    g = torch.Generator(device="cuda").manual_seed(0)
    m = moe_shape(moe_geometry)
    e, hid, inter = m["experts"], m["hidden"], m["inter"]
    w = {"moe": m, "w2": (torch.randn(e, hid, inter, device="cuda", generator=g) * 0.03).bfloat16(),
         "w13": (torch.randn(e, 2 * inter, hid, device="cuda", generator=g) * 0.03).bfloat16()}
    for key, shape in dense_shapes(dense_geometry).items():
        w[key] = (torch.randn(*shape, device="cuda", generator=g) * 0.02).bfloat16()
    if "lm_head" in gemms:
        w["lm_head"] = (torch.randn(VOCAB, H, device="cuda", generator=g) * 0.02).bfloat16()
    for key in ("qkv", "router", "o"):  # the dense GEMMs' weights, once each plus copies-1 more
        w[key + "_copies"] = [w[key]] + [(torch.randn(*w[key].shape, device="cuda", generator=g) * 0.02).bfloat16()
                                         for _ in range(copies - 1)]
    out_rows = []
    print("| gemm | tokens | form / tiles | ms | GB/s of weights | bits == reference |\n|---|---:|---|---:|---:|---|",
          flush=True)
    for gemm in gemms:
        for t in tokens:
            ref_fn, cands, mask, wbytes = _cases(gemm, t, g, w, mm, moe)
            ref = ref_fn()
            ref = ref[mask] if mask is not None else ref
            per = copies if gemm in ROLE else 1  # dense GEMMs run once per weight copy
            if forms:  # only the candidates whose form names one of ``forms`` (the reference always)
                cands = [c for c in cands if any(c[0] == f or c[0].startswith(f + " ") for f in forms)]
            for name, cfg, fn in [("reference", {}, ref_fn)] + cands:
                try:
                    ms = _time(fn) / per
                    got = fn()
                    got = got[mask] if mask is not None else got
                    same = bool(torch.equal(got, ref))
                except Exception as e:  # noqa: BLE001  (reported, not fatal)
                    print(f"| {gemm} | {t} | {_tag(name, cfg) if cfg else name} | failed: {type(e).__name__}: "
                          f"{str(e)[:90]} | | |", flush=True)
                    continue
                tag = _tag(name, cfg) if cfg else name
                print(f"| {gemm} | {t} | {tag} | {ms:.4f} | {wbytes / ms / 1e6:.0f} | {same} |", flush=True)
                out_rows.append({"gemm": gemm, "tokens": t, "form": tag, "ms": ms, "weight_gbps": wbytes / ms / 1e6,
                                 "same_bits": same})
            torch.cuda.empty_cache()
    best = {}
    for r in out_rows:
        if r["same_bits"]:
            k = (r["gemm"], r["tokens"])
            if k not in best or r["ms"] < best[k]["ms"]:
                best[k] = r
    print("\nfastest with the reference's bits:")
    for (gemm, t), r in sorted(best.items()):
        refms = next(x["ms"] for x in out_rows if x["gemm"] == gemm and x["tokens"] == t and x["form"] == "reference")
        print(f"  {gemm:8s} {t:5d}  {r['form']:38s} {r['ms']:.4f} ms  (reference {refms:.4f})")
    return out_rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 256, 4096])
    ops = ("down", "down_flat", "down_w2", "gate_up", "o_proj", "o_proj_flat", "o_proj_w2", "qkv", "router", "lm_head",
           "qk_norm", "align", "combine")
    ap.add_argument("--gemms", nargs="+", choices=ops, default=list(ops))
    ap.add_argument("--copies", type=int, default=1,
                    help="time qkv, router and o_proj_flat over this many copies of the weight (HBM, not L2)")
    ap.add_argument("--dense-geometry", help="take qkv, router and o_proj_flat's shapes from this geometry of "
                    "benchmarks/geometries.py (default: 30B-A3B's layer)")
    ap.add_argument("--moe-geometry", help="take down, down_flat and gate_up's shapes (experts, top-k, hidden, "
                    "moe_intermediate) from this geometry of benchmarks/geometries.py (default: 30B-A3B's layer)")
    ap.add_argument("--forms", nargs="+", help="time only the candidates of these forms (e.g. rollout seg_tree_smem; "
                    "a form and its variants: \"seg_tree\" keeps \"seg_tree order\"), beside the reference")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    from true_on_policy.harness.provenance import provenance, write_evidence

    prov = provenance(None if argv is None else ["python", "benchmarks/gemm_sweep.py", *argv])
    rows = run(a.tokens, a.gemms, a.copies, a.dense_geometry, a.moe_geometry, a.forms)
    if a.out:
        write_evidence(a.out, {"copies": a.copies, "forms": a.forms, "dense_geometry": a.dense_geometry or "a3b48 (layer)",
                               "dense_shapes": dense_shapes(a.dense_geometry),
                               "moe_geometry": a.moe_geometry or "a3b48 (layer)", "moe_shape": moe_shape(a.moe_geometry),
                               "rows": rows}, prov)


if __name__ == "__main__":
    main()
