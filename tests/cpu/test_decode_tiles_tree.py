"""Decode tiles of the tree GEMMs (``kernels.matmul.split_tiles``, ``tree_tiles``, ``seg_tiles``).

- the rules are pure functions of the shapes and the SM count, and every tile they return (o_proj
  and the MoE down projection of 30B-A3B, 235B-A22B and an odd geometry, at the local segment
  counts of TP 1/2/4/8, at 1 to 4096 rows, with and without ``DECODE_TILES``) is one of
  ``candidate_tiles``, what the GPU tier checks bitwise; BLOCK_K (seg_tree's BK) is the fixed tile's;
- at one row they keep >= PROGRAMS_PER_SM x SMs programs busy where a candidate can (``split_matmul``
  with the fixed path's segments per plane); where ``plain_decode`` (o_proj) or ``grouped_decode``
  (down) does not hold and with ``DECODE_TILES`` off they give the fixed tiles and launch exactly;
- interpreted (TRITON_INTERPRET=1), every such tile (and plane split) computes the fixed tiles'
  bits: ``split_matmul``, ``matmul(tree=True)`` (ROW_FLAT and ROW) and ``seg_tree`` over the whole
  table and as the decode path launches it (the block loop over ``used_blocks``' blocks), ``seg_tree``
  also with the weights by tensor descriptor (``tma``), and the launchers' dispatch gives the same bits
  with the switches on and off (``grouped_matmul`` passes ``tma`` exactly when ``SEG_TMA`` is on).
"""

import json

import pytest
import triton
from helpers import run_py
from true_on_policy.kernels import matmul as mm
from true_on_policy.kernels import seg_tree as st

# hidden, query heads, KV heads, head_dim, experts, top-k, moe_intermediate
GEOMETRIES = {"30b_a3b": (2048, 32, 4, 128, 128, 8, 768), "235b_a22b": (4096, 64, 4, 128, 128, 8, 1536),
              "h1536e256k6": (1536, 24, 6, 128, 256, 6, 512)}
ROWS = (1, 2, 3, 7, 8, 16, 64, 255, 256, 257, 4096)
SMS = (132, 78, 144)
SEGMENTS = (8, 4, 2, 1)  # local segments at TP 1, 2, 4, 8 (K sharded alike)


def cases():
    """(name, geometry, local segments, o_proj (N, K), down (E, N, K)) at each TP degree."""
    for name, (h, hq, _, d, e, k, i) in GEOMETRIES.items():
        for s in SEGMENTS:
            yield name, (e, k), s, (h, hq * d * s // 8), (e, h, i * s // 8)


def tiles(rows, sms):
    """name -> (tile, per plane or None, busy programs) of the tree GEMMs at ``rows`` rows (tokens)."""
    for name, (e, k), s, (n, kk), (_, nd, kd) in cases():
        cfg, pp = mm.split_tiles(rows, n, kk, s, sms)
        yield (name, s, "split"), cfg, pp, triton.cdiv(rows, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]) * (s // pp)
        for fixed in (mm.ROW_FLAT, mm.ROW):
            cfg = mm.tree_tiles(fixed, rows, n, kk, sms)
            yield ((name, s, "tree"), cfg, None,
                   triton.cdiv(rows, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"] * cfg.get("N_GROUP", 1)))
        cfg = mm.seg_tiles(rows, rows * k, e, nd, kd, s, sms)
        yield (name, s, "seg_tree"), cfg, None, mm.expert_groups(rows * k, e)[0] * triton.cdiv(nd, cfg["BLOCK_N"])


@pytest.mark.parametrize("decode", [True, False])
def test_every_tile_is_a_candidate_with_the_fixed_k_chunks(decode, monkeypatch):
    monkeypatch.setattr(mm, "DECODE_TILES", decode)
    for rows in ROWS:
        for sms in SMS:
            for (name, s, role), cfg, pp, _ in tiles(rows, sms):
                assert cfg in mm.candidate_tiles(role), (name, s, role, rows, sms)
                assert pp is None or (pp in (1, 2, 4) and s % pp == 0), (name, s, rows, pp)
                fixed = {"split": mm.ROW, "seg_tree": mm.ROW_SEG}.get(role)
                key = "BK" if role == "seg_tree" else "BLOCK_K"
                assert role == "tree" or cfg[key] == fixed[key], (name, role, cfg)
    assert all(c["BLOCK_K"] in (mm.ROW["BLOCK_K"], mm.ROW_FLAT["BLOCK_K"]) for c in mm.candidate_tiles("tree"))
    assert all(c.get("FLAT", False) == (c["BLOCK_K"] == mm.ROW_FLAT["BLOCK_K"]) for c in mm.candidate_tiles("tree"))
    assert mm.candidate_tiles("split")[0] is mm.ROW and mm.candidate_tiles("seg_tree")[0] is mm.ROW_SEG


def test_the_rules_are_pure_functions_of_the_shapes(monkeypatch):
    monkeypatch.setattr(mm, "DECODE_TILES", True)
    args = [(rows, sms) for rows in ROWS if rows <= mm.DECODE_ROWS for sms in SMS]

    def run(order):
        mm.split_decode_tile.cache_clear()
        mm.seg_decode_tile.cache_clear()
        return [list(tiles(*a)) for a in order]

    forward, backward = run(args), run(args[::-1])[::-1]
    assert forward == backward
    split = [(r, n, kk, s, sms) for r, sms in args for _, _, s, (n, kk), _ in cases()]
    assert [mm.split_decode_tile(*a) for a in split] == [mm.split_decode_tile.__wrapped__(*a) for a in split]
    seg = [(r * k, e, nd, kd, s, sms) for r, sms in args for _, (e, k), s, _, (_, nd, kd) in cases()]
    assert [mm.seg_decode_tile(*a) for a in seg] == [mm.seg_decode_tile.__wrapped__(*a) for a in seg]
    assert all(mm.seg_decode_tile(*a) is mm.seg_decode_tile(*a) for a in seg)  # cached: one dict per shape


def most_programs(key, rows):
    """The most busy programs any candidate gives at ``rows`` rows whose programs stream >=
    MIN_PROGRAM_BYTES of weights (what the rule may take; none: the widest tile's), by brute force."""
    name, s, role = key
    _, (e, k), _, (n, kk), (_, nd, kd) = [c for c in cases() if c[0] == name and c[2] == s][0]
    bm = next(b for b in mm.DECODE_BM if b >= rows)
    if role == "split":
        pp = mm.fixed_per_plane(s)
        return max(triton.cdiv(n, bn) * (s // pp) for bn in mm.DECODE_BN
                   if 2 * bn * (kk // s) * pp >= mm.MIN_PROGRAM_BYTES)  # (a 128-wide tile always does here)
    if role == "tree":
        return max(triton.cdiv(n, bn) for bn in mm.DECODE_BN if 2 * bn * kk >= mm.MIN_PROGRAM_BYTES)
    used, per = mm.expert_groups(rows * k, e)
    bm = next(b for b in mm.DECODE_BM if b >= per)
    return max((used * triton.cdiv(nd, bn) for bn in mm.DECODE_BN
                if 2 * bn * kd >= mm.MIN_PROGRAM_BYTES and st.smem_ok(kd // s, mm.SEG_GRID[bm, bn])),
               default=used * triton.cdiv(nd, max(mm.DECODE_BN)))


def test_one_row_fills_the_gpu(monkeypatch):
    """At one row (token): >= PROGRAMS_PER_SM x SMs busy programs where a candidate gives them (every
    down projection at TP 1 here), else the most any candidate gives; and at
    least twice the fixed tiles' busy programs where those fall short and a candidate gives that many."""
    for sms in SMS:
        monkeypatch.setattr(mm, "DECODE_TILES", False)
        old = {key: busy for key, _, _, busy in tiles(1, sms)}
        monkeypatch.setattr(mm, "DECODE_TILES", True)
        for key, cfg, pp, busy in tiles(1, sms):
            best = most_programs(key, 1)
            assert busy >= min(best, mm.PROGRAMS_PER_SM * sms), (key, sms, cfg, pp, busy, best)
            assert busy >= min(2 * old[key], best, mm.PROGRAMS_PER_SM * sms), (key, sms, busy, old[key])
            if key[2] == "seg_tree" and key[1] == 8:
                assert busy >= mm.PROGRAMS_PER_SM * sms, (key, sms, cfg, pp, busy)
    # a shape too small to fill the GPU takes the most programs a tile gives
    assert mm.split_decode_tile(1, 64, 1024, 8, 132) == (mm.SPLIT_GRID[16, 128], 2)  # 4 planes of 1 tile


def test_seg_tiles_fit_shared_memory(monkeypatch):
    monkeypatch.setattr(mm, "DECODE_TILES", True)
    for rows in (r for r in ROWS if r <= mm.DECODE_ROWS):
        for (name, s, role), cfg, _, _ in tiles(rows, 132):
            if role == "seg_tree":
                kd = [c[4][2] for c in cases() if c[0] == name and c[2] == s][0]
                assert st.fits(kd // s, cfg["BK"]) and st.smem_ok(kd // s, cfg), (name, s, rows, cfg)


def test_split_keeps_the_fixed_segments_per_plane(monkeypatch):
    monkeypatch.setattr(mm, "DECODE_TILES", True)
    for rows in ROWS:
        for (name, s, role), _, pp, _ in tiles(rows, 132):
            assert role != "split" or pp == mm.fixed_per_plane(s), (name, s, rows, pp)


def outside(key, rows):
    """Whether the tree GEMM ``key`` takes its fixed tiles at ``rows`` rows (tokens) with the switch on."""
    name, _, role = key
    if role == "seg_tree":
        e, k = GEOMETRIES[name][4], GEOMETRIES[name][5]
        return not mm.grouped_decode(rows, rows * k, e)
    return not mm.plain_decode(rows)


def test_where_they_do_not_apply_and_switched_off_the_fixed_tiles(monkeypatch):
    for decode in (True, False):
        monkeypatch.setattr(mm, "DECODE_TILES", decode)
        for rows in ROWS:
            for key, cfg, pp, _ in tiles(rows, 132):
                name, s, role = key
                if decode and not outside(key, rows):
                    continue
                fixed = {"split": mm.ROW, "seg_tree": mm.ROW_SEG}.get(role)
                if role == "tree":
                    assert cfg is mm.ROW_FLAT or cfg is mm.ROW, (name, s, rows, cfg)
                else:
                    assert cfg is fixed, (name, s, role, rows)
                assert pp in (None, mm.PER_PLANE if s % mm.PER_PLANE == 0 else 1)
    monkeypatch.setattr(mm, "DECODE_TILES", True)
    assert mm.seg_tiles(1, None, 128, 2048, 768, 8, 132) is mm.ROW_SEG  # no slots: no decode tile


INTERPRETED = r"""
import json, sys
import torch
from true_on_policy.kernels import grouped_tma as gt, matmul as mm, seg_tree as st
from true_on_policy.kernels.moe import align

tiles = json.load(open(sys.argv[1]))
g = torch.Generator().manual_seed(0)
mm.sm_count = lambda x: 132
# o_proj's tree: S segments of 32 columns (ROW_FLAT's BLOCK_K divides them; ROW masks its 64-wide chunk)
N, S = 80, 8
x = torch.randn(260, S * 32, generator=g).bfloat16()
w = (torch.randn(N, S * 32, generator=g) * 0.05).bfloat16()
for m in (1, 3, 17):
    xm = x[:m].clone()
    ref = mm.split_matmul(xm, w, S, torch.float32, per_plane=1, cfg=mm.ROW)
    for cfg in tiles["split"]:
        for pp in (1, 2, 4):
            got = mm.split_matmul(xm, w, S, torch.float32, per_plane=pp, cfg=cfg)
            assert torch.equal(got, ref), ("split", cfg, pp, m, (got - ref).abs().max().item())
    for cfg in tiles["tree"]:
        got = mm._launch(xm, w, torch.empty(m, N), None, None, m, S, cfg)
        assert torch.equal(got, ref), ("tree", cfg, m)
    for decode in (True, False):  # the launchers' dispatch, both ways
        mm.DECODE_TILES = decode
        assert torch.equal(mm.split_matmul(xm, w, S, torch.float32), ref), ("split_matmul", decode, m)
        assert torch.equal(mm.matmul(xm, w, torch.float32, S, tree=True), ref), ("matmul tree", decode, m)
        mm.FLAT_TREE = False
        assert torch.equal(mm.matmul(xm, w, torch.float32, S, tree=True), ref), ("matmul tree ROW", decode, m)
        mm.FLAT_TREE = True
    mm.DECODE_TILES = False
# the down projection's seg_tree: segments of 64 + 16 columns (BK chunk and tail), a trimmed table
E, ND, SD = 6, 40, 4
KD = SD * 80
# a start-up choice for these shapes (``choose_tree_tiles`` installs one on a GPU): two candidates, by rows per expert
for e_ in (E, 1):
    mm.TREE_CHOSEN[80, ND, e_] = ((1, mm.TREE_CANDIDATES[1]), (None, mm.TREE_CANDIDATES[3]))
xs = torch.randn(1024, KD, generator=g).bfloat16()  # the down projection's rows: the table's own (<= 7 blocks)
w2 = (torch.randn(E, ND, KD, generator=g) * 0.05).bfloat16()
wide_seen = []
for t, k, e in ((1, 2, E), (9, 3, E), (130, 1, 1)):
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).int()
    _, be, _, own = align(ids, 0, e)
    we = w2[:e].contiguous()
    p = own.shape[0]
    used = (be >= 0).repeat_interleave(mm.ALIGN) & (own >= 0)
    ref = st.launch(xs, we, torch.full((p, ND), float("nan")), own, be.repeat_interleave(mm.ALIGN // mm.ROW_SEG["BLOCK_M"]),
                    p, SD, mm.ROW_SEG, dot_f32=True)
    for cfg in tiles["seg_tree"]:
        for sub in (1, mm.ALIGN // cfg["BLOCK_M"]):
            count = p if sub == 1 else mm.used_blocks(t * k, e) * mm.ALIGN
            b = be.repeat_interleave(mm.ALIGN // (cfg["BLOCK_M"] * sub))
            got = st.launch(xs, we, torch.full((p, ND), float("nan")), own, b, count, SD, cfg, dot_f32=True, subtiles=sub)
            assert torch.equal(got[used], ref[used]), ("seg_tree", cfg, sub, t, k, e)
            got = st.launch(xs, we, torch.full((p, ND), float("nan")), own, b, count, SD, cfg, dot_f32=True, subtiles=sub,
                            tma=True)  # the weights by tensor descriptor (TRUE_ON_POLICY_SEG_TMA=tma)
            assert torch.equal(got[used], ref[used]), ("seg_tree tma", cfg, sub, t, k, e)
    # grouped_matmul's dispatch to seg_tree (taken as on a GPU, the interpreter's fp64 stand-in kept)
    launch, mm.INTERPRETED, usable, tma, cfgs = st.launch, False, gt.usable, [], []
    st.launch = lambda *a, **kw: tma.append(kw["tma"]) or cfgs.append(a[7]) or launch(*a, **dict(kw, dot_f32=True))
    gt.usable = lambda x, w: True  # a Hopper GPU's answer
    for decode in (True, False):
        mm.DECODE_TILES = decode
        for seg_tma in (False, True):
            for fixed in (False, True):
                mm.SEG_TMA, mm.TREE_FIXED = seg_tma, fixed
                got = mm.grouped_matmul(xs, we, own, be, torch.float32, SD, tree=True, tokens=t, slots=t * k)
                assert torch.equal(got[used], ref[used]), ("grouped_matmul", decode, seg_tma, fixed, t)
                assert tma.pop() is seg_tma, ("the weights by TMA exactly when SEG_TMA is on", decode, seg_tma)
                if not mm.grouped_decode(t, t * k, e):  # above the decode path: the choice's tile, ROW_SEG under TREE_FIXED
                    want = mm.ROW_SEG if fixed else mm.by_rows(mm.TREE_CHOSEN[KD // SD, ND, e], mm.expert_groups(t * k, e)[1])
                    assert cfgs.pop() == want, ("the chosen tile unless TREE_FIXED", decode, fixed, t)
    # where the segments are too wide for ROW_SEG's stages (``seg_path`` false, as at Coder-480B-A35B's 320 columns):
    # at decode token counts seg_tree in its decode tile (``wide_decode``); above, the flat loop, unless the choice
    # timed a seg_tree tile faster than it at the call's rows per expert
    path, flat_launch, launched = mm.seg_path, mm._launch, []

    def flat(*a, **kw):  # the flat loop with the interpreter's fp64 stand-in, as the dispatch decides on a GPU
        launched.append("flat")
        mm.INTERPRETED = True
        try:
            return flat_launch(*a, **kw)
        finally:
            mm.INTERPRETED = False
    mm.seg_path, mm._launch, mm.DECODE_TILES = (lambda k, s: False), flat, True
    st.launch = lambda *a, **kw: launched.append(a[7]) or launch(*a, **dict(kw, dot_f32=True))
    base = mm._tiles(SD, True, KD)  # the flat loop's tile
    mm.TREE_CHOSEN[80, ND, e] = ((1, base), (None, mm.TREE_CANDIDATES[2]))
    # the flat loop's own result: the interpreter's fp64 stand-in rounds once per dot, so its chunks (ROW's masked
    # 64 columns against seg_tree's 64 and a 16-column tail) round apart; on a GPU they give the same bits (GPU tier)
    fref = flat(xs, we, torch.full((p, ND), float("nan")), own, be.repeat_interleave(mm.ALIGN // base["BLOCK_M"]),
                p, SD, base)
    launched.clear()
    for fixed in (False, True):
        mm.TREE_FIXED = fixed
        got = mm.grouped_matmul(xs, we, own, be, torch.float32, SD, tree=True, tokens=t, slots=t * k)
        above = not mm.grouped_decode(t, t * k, e) and mm.expert_groups(t * k, e)[1] > 1
        want = (mm.seg_tiles(t, t * k, e, ND, KD, SD, mm.sm_count(xs)) if mm.wide_decode(t, t * k, e, KD, SD)
                else mm.TREE_CANDIDATES[2] if above and not fixed else "flat")
        assert launched.pop() == want and not launched, ("wide segments: the tile timed faster", fixed, t, want)
        assert torch.equal(got[used], (fref if want == "flat" else ref)[used]), ("wide segments", fixed, t)
        wide_seen.append("flat" if want == "flat" else "seg_tree" if above else "decode")
    mm.seg_path, mm._launch = path, flat_launch
    st.launch, mm.INTERPRETED, mm.DECODE_TILES, mm.SEG_TMA, mm.TREE_FIXED, gt.usable = launch, True, False, False, False, usable
assert set(wide_seen) == {"flat", "seg_tree", "decode"}, wide_seen  # every outcome of the wide dispatch ran
print("interpreted-ok")
"""


def test_tree_decode_tiles_compute_the_same_bits_interpreted(tmp_path, monkeypatch):
    """The tiles the rules pick for the real geometries (and the fixed ones) on small shapes."""
    picked = {"split": [], "tree": [], "seg_tree": []}
    for decode in (True, False):
        monkeypatch.setattr(mm, "DECODE_TILES", decode)
        for rows in ROWS:
            for sms in SMS:
                for (_, _, role), cfg, _, _ in tiles(rows, sms):
                    if cfg not in picked[role]:
                        picked[role].append(cfg)
    for cfg in mm.candidate_tiles("seg_tree")[:2 * len(mm.TREE_CANDIDATES)]:  # what the start-up choice may give
        if cfg not in picked["seg_tree"]:  # the tree above the decode path, at 3 stages and at 2
            picked["seg_tree"].append(cfg)
    (tmp_path / "tiles.json").write_text(json.dumps(picked))
    (tmp_path / "script.py").write_text(INTERPRETED)
    r = run_py(f"import runpy, sys; sys.argv = ['x', {str(tmp_path / 'tiles.json')!r}]; "
               f"runpy.run_path({str(tmp_path / 'script.py')!r}, run_name='__main__')",
               env_extra={"TRITON_INTERPRET": "1", "OPENBLAS_NUM_THREADS": "1"}, timeout=600)
    assert r.returncode == 0 and "interpreted-ok" in r.stdout, r.stderr[-3000:]
