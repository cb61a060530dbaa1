"""Decode tiles from the geometry (``kernels.matmul.decode_tile``, ``tma_tiles``, ``grouped_tiles``).

- the rule is a pure function of the shapes and the SM count, and every tile it returns (for the
  Qwen3-MoE layer GEMMs of 30B-A3B, 235B-A22B and an odd geometry, at 1 to 4096 rows, with and
  without ``DECODE_TILES``) is one of ``candidate_tiles(role)``, what the GPU tier checks bitwise;
- it applies where each weight streams about once (``plain_decode``: one row tile holds the rows;
  ``grouped_decode``: at most half a 16-row tile of expected rows per expert in use); there a grouped
  GEMM keeps >= PROGRAMS_PER_SM x SMs programs busy where a candidate can, with the widest such tile,
  and a dense one (``dense_decode_tile``) >= DENSE_PROGRAMS_PER_SM x SMs, with 64-row tiles where even
  the narrowest give fewer than FEW_PROGRAMS_PER_SM x SMs and 256-wide K chunks where WIDE_GRID holds
  the tile; elsewhere (and with ``DECODE_TILES`` off) it gives the fixed tiles (the MoE GEMMs': ``moe_tile``'s,
  test_moe_tiles.py);
- ``used_blocks`` bounds the blocks ``moe.align`` fills, so the programs it trims do no work;
- interpreted (TRITON_INTERPRET=1, 16-wide fp32 rounding steps: ``matmul.interpreted_dot``), every
  such tile computes the bits of the fixed tiles and of the 16-step reference, plain and grouped,
  with and without the grouped block loop, and the launchers' dispatch gives the same bits.
"""

import json

import pytest
import torch
import triton
from helpers import run_py
from true_on_policy.kernels import matmul as mm
from true_on_policy.kernels.limits import KernelLimitError

# hidden, query heads, KV heads, head_dim, experts, top-k, moe_intermediate
GEOMETRIES = {"30b_a3b": (2048, 32, 4, 128, 128, 8, 768), "235b_a22b": (4096, 64, 4, 128, 128, 8, 1536),
              "h1536e256k6": (1536, 24, 6, 128, 256, 6, 512)}
ROWS = (1, 2, 3, 7, 8, 16, 64, 255, 256, 257, 4096)
SMS = (132, 78, 144)


def layer_gemms(h, hq, hkv, d, e, k, i):
    """name -> (candidate role, N, K) of a layer's TMA GEMMs, and the lm_head over Qwen3's vocabulary."""
    return {"qkv": ("plain", (hq + 2 * hkv) * d, h), "o_proj": ("row", h, hq * d), "router": ("router", e, h),
            "gate_up": ("gate_up", 2 * i, h), "down": ("down", h, i), "lm_head": ("lm_head", 151936, h)}


def tile(role, n, k, rows, geometry, sms):
    e, top_k = geometry[4], geometry[5]
    if role in ("gate_up", "down"):
        return mm.grouped_tiles("down" if role == "down" else "plain", rows, rows * top_k, e, n, k, sms)
    return mm.tma_tiles(role, rows, n, k, sms)


def applies(role, rows, geometry):
    """Whether the rule gives the GEMM of ``role`` decode tiles at ``rows`` rows (tokens)."""
    if role in ("gate_up", "down"):
        return mm.grouped_decode(rows, rows * geometry[5], geometry[4])
    return mm.plain_decode(rows)


def busy(role, cfg, n, rows, geometry):
    """Programs with real work: row tiles x column tiles, or experts in use x column tiles (grouped)."""
    if role in ("gate_up", "down"):
        return mm.expert_groups(rows * geometry[5], geometry[4])[0] * triton.cdiv(n, cfg["BLOCK_N"])
    return triton.cdiv(rows, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"])


def cases():
    for name, g in GEOMETRIES.items():
        for gemm, (role, n, k) in layer_gemms(*g).items():
            yield name, g, gemm, role, n, k


@pytest.mark.parametrize("decode", [True, False])
def test_every_tile_is_a_candidate(decode, monkeypatch):
    monkeypatch.setattr(mm, "DECODE_TILES", decode)
    for name, g, gemm, role, n, k in cases():
        cands = mm.candidate_tiles(role)
        for rows in ROWS:
            for sms in SMS:
                assert tile(role, n, k, rows, g, sms) in cands, (name, gemm, rows, sms)
    for role, fixed in (("plain", [mm.TMA["plain"]]), ("row", mm.table_tiles(mm.ROW_TMA)),
                        ("router", [mm.TMA["router"]]),
                        ("gate_up", [mm.GROUPED_UP_TMA, *mm.table_tiles(mm.GROUPED_UP_ROWS)]),
                        ("down", mm.table_tiles(mm.DOWN_TMA) + mm.table_tiles(mm.DOWN_TOKENS)),
                        ("lm_head", [mm.TMA["lm_head"]])):
        assert all(c in mm.candidate_tiles(role) for c in fixed), role


def test_the_rule_is_a_pure_function_of_the_shapes():
    args = [(rows, n, k, sms) for _, _, _, _, n, k in cases() for rows in ROWS if rows <= mm.DECODE_ROWS
            for sms in SMS]
    mm.decode_tile.cache_clear()
    forward = [mm.decode_tile(*a) for a in args]
    mm.decode_tile.cache_clear()
    backward = [mm.decode_tile(*a) for a in reversed(args)][::-1]
    assert forward == backward == [mm.decode_tile.__wrapped__(*a) for a in args]
    assert all(mm.decode_tile(*a) is mm.decode_tile(*a) for a in args)  # cached: one dict per shape
    assert all(c in mm.DECODE_GRID.values() for c in forward)
    mm.dense_decode_tile.cache_clear()
    dense = [mm.dense_decode_tile(*a) for a in args]
    assert dense == [mm.dense_decode_tile.__wrapped__(*a) for a in args]
    assert all(c in mm.DENSE_GRID.values() for c in dense)
    assert mm.expert_groups(8, 128) == (8, 1) and mm.expert_groups(6, 256) == (6, 1)  # top-k experts are distinct


def test_decode_rows_fill_the_gpu(monkeypatch):
    """Where the grouped GEMMs' decode tiles apply: >= PROGRAMS_PER_SM x SMs busy programs with the widest
    tile that gives them, else the most programs a tile allowed for K gives."""
    monkeypatch.setattr(mm, "DECODE_TILES", True)
    for name, g, gemm, role, n, k in cases():
        if role not in ("gate_up", "down"):
            continue
        for rows in (r for r in ROWS if applies(role, r, g)):
            for sms in SMS:
                cfg = tile(role, n, k, rows, g, sms)
                need = mm.PROGRAMS_PER_SM * sms
                widths = [bn for bn in mm.DECODE_BN if 2 * bn * k >= mm.MIN_PROGRAM_BYTES]
                progs = {bn: busy(role, dict(cfg, BLOCK_N=bn), n, rows, g) for bn in widths}
                tag = (name, gemm, rows, sms, cfg)
                if max(progs.values()) >= need:
                    assert progs[cfg["BLOCK_N"]] >= need, tag
                    assert all(progs[bn] < need for bn in widths if bn > cfg["BLOCK_N"]), tag
                else:
                    assert cfg["BLOCK_N"] == min(widths), tag
                assert cfg["BLOCK_M"] == next((b for b in mm.DECODE_BM if b >= (rows if role not in ("gate_up", "down")
                                               else mm.expert_groups(rows * g[5], g[4])[1])), 64), tag


def test_dense_decode_tiles_follow_their_rule(monkeypatch):
    """Where the dense GEMMs' decode tiles apply (qkv, o_proj, router, lm_head): BLOCK_N the widest of the
    widths allowed for K giving >= DENSE_PROGRAMS_PER_SM x SMs programs, else the narrowest; BLOCK_M the
    smallest holding the rows, or 64 where the programs stay under FEW_PROGRAMS_PER_SM x SMs; BLOCK_K 256
    exactly where K >= LONG_K is a multiple of it and a stage of the tile fits WIDE_STAGE_BYTES (4 stages);
    every tile keeps the K loop's 16-wide steps (a grid tile: BLOCK_K 64, 128 or 256)."""
    monkeypatch.setattr(mm, "DECODE_TILES", True)
    seen = set()
    for name, g, gemm, role, n, k in cases():
        if role in ("gate_up", "down"):
            continue
        for rows in (r for r in ROWS if applies(role, r, g)):
            for sms in SMS:
                cfg = tile(role, n, k, rows, g, sms)
                tag = (name, gemm, rows, sms, cfg)
                need = int(mm.DENSE_PROGRAMS_PER_SM * sms)
                widths = [bn for bn in mm.DECODE_BN if 2 * bn * k >= mm.MIN_PROGRAM_BYTES]
                bm = next(b for b in mm.DECODE_BM if b >= rows)
                progs = {bn: triton.cdiv(rows, bm) * triton.cdiv(n, bn) for bn in widths}
                if max(progs.values()) >= need:
                    assert progs[cfg["BLOCK_N"]] >= need, tag
                    assert all(progs[bn] < need for bn in widths if bn > cfg["BLOCK_N"]), tag
                else:
                    assert cfg["BLOCK_N"] == min(widths), tag
                few = progs[cfg["BLOCK_N"]] < mm.FEW_PROGRAMS_PER_SM * sms
                assert cfg["BLOCK_M"] == (64 if few else bm), tag
                stage = (cfg["BLOCK_M"] + cfg["BLOCK_N"]) * 256 * 2
                wide = k >= mm.LONG_K and k % 256 == 0 and stage <= mm.WIDE_STAGE_BYTES
                assert cfg["BLOCK_K"] == (256 if wide else 128 if k >= mm.LONG_K else 64), tag
                assert cfg["num_stages"] * (cfg["BLOCK_M"] + cfg["BLOCK_N"]) * cfg["BLOCK_K"] * 2 <= 160 * 1024, tag
                seen.add((gemm, cfg["BLOCK_M"], cfg["BLOCK_K"]))
    # each branch is taken: 256-wide chunks (qkv, o_proj), 64-row router tiles, 128-wide (lm_head)
    assert {("qkv", 16, 256), ("o_proj", 16, 256), ("router", 64, 256), ("lm_head", 16, 128)} <= seen, seen


def test_one_row_busies_more_programs_than_the_fixed_tiles(monkeypatch):
    """At one row the decode tile keeps at least as many programs busy as the fixed tile, the grouped
    GEMMs' twice as many; the lm_head's each do an eighth of the fixed tile's MMA work (16 rows, not 128)."""
    for name, g, gemm, role, n, k in cases():
        monkeypatch.setattr(mm, "DECODE_TILES", True)
        cfg = tile(role, n, k, 1, g, 132)
        new = busy(role, cfg, n, 1, g)
        monkeypatch.setattr(mm, "DECODE_TILES", False)
        fixed = tile(role, n, k, 1, g, 132)
        old = busy(role, fixed, n, 1, g)
        if role == "lm_head":
            assert new >= old and cfg["BLOCK_M"] * 8 == fixed["BLOCK_M"], (name, new, old, cfg, fixed)
        elif role in ("gate_up", "down"):
            assert new >= 2 * old, (name, gemm, new, old)
        else:
            assert new >= old, (name, gemm, new, old)


def test_decode_tiles_apply_where_each_weight_streams_once(monkeypatch):
    """Plain GEMMs: while one row tile holds every row. Grouped: while the expected rows per expert in
    use fill at most half a 16-row tile (30B-A3B's 128 experts, top-8: 5 rows at 64 tokens, 16 at
    256; 256 experts, top-6: 7 at 256 tokens); never without the routed pairs or with the switch off."""
    monkeypatch.setattr(mm, "DECODE_TILES", True)
    assert mm.plain_decode(mm.DECODE_PLAIN_ROWS) and not mm.plain_decode(mm.DECODE_PLAIN_ROWS + 1)
    assert all(mm.decode_bm(r) >= r for r in range(1, mm.DECODE_PLAIN_ROWS + 1))  # one row tile
    assert mm.expert_groups(64 * 8, 128)[1] == 5 and mm.grouped_decode(64, 64 * 8, 128)
    assert mm.expert_groups(256 * 8, 128)[1] == 16 and not mm.grouped_decode(256, 256 * 8, 128)
    assert mm.expert_groups(256 * 6, 256)[1] == 7 and mm.grouped_decode(256, 256 * 6, 256)
    assert not mm.grouped_decode(mm.DECODE_ROWS + 1, (mm.DECODE_ROWS + 1) * 6, 4096)
    assert not mm.grouped_decode(1, None, 128) and not mm.grouped_decode(None, 8, 128)
    monkeypatch.setattr(mm, "DECODE_TILES", False)
    assert not mm.plain_decode(1) and not mm.grouped_decode(1, 8, 128)


def test_where_they_do_not_apply_and_switched_off_the_fixed_tiles(monkeypatch):
    def fixed(role, rows, g):
        if role in ("gate_up", "down"):  # by the rows per expert in use
            per = mm.expert_groups(rows * g[5], g[4])[1]
            return mm.by_rows(mm.DOWN_TMA if role == "down" else mm.GROUPED_UP_ROWS, per)
        return mm.by_rows(mm.TMA[role], rows)

    monkeypatch.setattr(mm, "DECODE_TILES", True)
    for name, g, gemm, role, n, k in cases():
        outside = [r for r in ROWS if not applies(role, r, g)]
        assert mm.DECODE_ROWS + 1 in outside and 4096 in outside, (name, gemm, outside)
        for rows in outside:
            assert tile(role, n, k, rows, g, 132) is fixed(role, rows, g), (name, gemm, rows)
        monkeypatch.setattr(mm, "DECODE_TILES", False)
        assert all(tile(role, n, k, rows, g, 132) is fixed(role, rows, g) for rows in ROWS), (name, gemm)
        monkeypatch.setattr(mm, "DECODE_TILES", True)
    assert mm.tma_tiles("lm_head", 1, 151936, 2048, 132) in mm.DECODE_GRID.values()
    assert mm.tma_tiles("lm_head", mm.DECODE_PLAIN_ROWS + 1, 151936, 2048, 132) is mm.TMA["lm_head"]


@pytest.mark.parametrize("experts,top_k", [(128, 8), (256, 6), (2, 2), (3, 1), (5, 3)])
def test_used_blocks_bound_the_table(experts, top_k):
    """The blocks ``align`` fills never pass ``used_blocks``: uniform, skewed (a few experts take
    every token, more than ALIGN rows each) and single-expert routings."""
    from true_on_policy.kernels.moe import align_reference

    g = torch.Generator().manual_seed(experts * 10 + top_k)
    for t in (1, 2, 3, 16, 63, 64, 65, 129, 300):
        uniform = torch.rand(t, experts, generator=g).argsort(dim=1)[:, :top_k]
        skewed = torch.arange(top_k).expand(t, top_k)
        for ids in (uniform, skewed):
            _, be, _ = align_reference(ids.int(), 0, experts)
            assert be.shape[0] == triton.cdiv(t * top_k, mm.ALIGN) + experts
            assert int((be >= 0).sum()) <= mm.used_blocks(t * top_k, experts) <= be.shape[0], (t, ids[0])


def test_grouped_matmul_refuses_slots_that_did_not_build_its_table():
    x, w = torch.zeros(4, 64, dtype=torch.bfloat16), torch.zeros(2, 32, 64, dtype=torch.bfloat16)
    rows, be = torch.zeros(3 * mm.ALIGN, dtype=torch.int64), torch.zeros(3, dtype=torch.int32)  # 1 + 2 blocks
    for tokens, slots in ((4, 200), (None, 8), (4, 0)):
        with pytest.raises(KernelLimitError, match="slots"):
            mm.grouped_matmul(x, w, rows, be, tokens=tokens, slots=slots)


INTERPRETED = r"""
import json, sys
import torch
from true_on_policy.kernels import grouped_tma, matmul as mm
from true_on_policy.kernels.moe import align

tiles = json.load(open(sys.argv[1]))
g = torch.Generator().manual_seed(0)


def ref16(x, w):  # one fp32 accumulator, 16-wide steps of exact products from k = 0 upward
    acc = torch.zeros(x.shape[0], w.shape[0])
    for s in range(0, x.shape[1], 16):
        acc = acc + (x[:, s:s + 16].double() @ w[:, s:s + 16].double().T).float()
    return acc


N, K = 80, 320  # neither a multiple of the tiles' BLOCK_N nor of BLOCK_K 128
x = torch.randn(130, K, generator=g).bfloat16()
w = (torch.randn(N, K, generator=g) * 0.05).bfloat16()
full = ref16(x[:70], w)
for cfg in tiles["plain"]:
    for m in (1, 3, 17, 70):
        out = mm._launch_tma(x[:m].clone(), w, torch.empty(m, N), cfg, dot_step=16)
        assert torch.equal(out, full[:m]), ("plain", cfg, m, (out - full[:m]).abs().max().item())
# the grouped form: uniform routing, and one expert with more than ALIGN rows (two blocks)
E, NG, KG = 6, 40, 160
xg = x[:, :KG].contiguous()
w13 = (torch.randn(E, NG, KG, generator=g) * 0.05).bfloat16()
for t, k, e in ((1, 2, E), (9, 3, E), (130, 1, 1)):
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).int()
    rows, be, _, _ = align(ids, 0, e)
    we = w13[:e].contiguous()
    used = (be >= 0).repeat_interleave(mm.ALIGN) & (rows >= 0)
    ref = torch.full((rows.shape[0], NG), float("nan"))
    for p in used.nonzero()[:, 0].tolist():
        ref[p] = ref16(xg[rows[p]:rows[p] + 1], we[be[p // mm.ALIGN]])[0]
    for cfg in tiles["grouped"]:
        for sub in (1, mm.ALIGN // cfg["BLOCK_M"]):  # one tile per program, or the block loop over the trimmed table
            count = rows.shape[0] if sub == 1 else mm.used_blocks(t * k, e) * mm.ALIGN
            b = be.repeat_interleave(mm.ALIGN // (cfg["BLOCK_M"] * sub))
            out = grouped_tma.launch(xg, we, torch.full((rows.shape[0], NG), float("nan")), rows, b, count, cfg,
                                     dot_step=16, subtiles=sub)
            assert torch.equal(out[used], ref[used]), ("grouped", cfg, sub, t, k, e)
# the launchers' dispatch (TMA taken as on Hopper): the rule's tile, trimmed grid and block loop ==
# the same tile launched one tile per program over the whole table (interpreted per-chunk rounding)
grouped_tma.usable = lambda x, w: True
mm.hopper = lambda x: True
mm.sm_count = lambda x: 132
for t in (1, 9, 40):
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(t)]).int()
    rows, be, _, own = align(ids, 0, E)
    used = (be >= 0).repeat_interleave(mm.ALIGN) & (rows >= 0)
    for role in ("plain", "down"):
        cfg = mm.grouped_tiles(role, t, 2 * t, E, NG, KG, 132)
        got = mm.grouped_matmul(xg, w13, rows, be, torch.float32, role=role, tokens=t, slots=2 * t)
        b = be.repeat_interleave(mm.ALIGN // cfg["BLOCK_M"])
        want = grouped_tma.launch(xg, w13, torch.empty_like(got), rows, b, rows.shape[0], cfg)
        assert torch.equal(got[used], want[used]), (role, t, cfg)
    xm = x[:t].clone()
    for role in mm.DECODE_ROLES:
        cfg = mm.tma_tiles(role, t, N, K, 132)
        assert torch.equal(mm.matmul(xm, w, torch.float32, role=role),
                           mm._launch_tma(xm, w, torch.empty(t, N), cfg)), (role, t)
print("interpreted-ok")
"""


def test_decode_tiles_compute_the_same_bits_interpreted(tmp_path, monkeypatch):
    plain, grouped = [], []
    for decode in (True, False):
        monkeypatch.setattr(mm, "DECODE_TILES", decode)
        for _, g, _, role, n, k in cases():
            for rows in ROWS:
                for sms in SMS:
                    cfg = tile(role, n, k, rows, g, sms)
                    bucket = grouped if role in ("gate_up", "down") else plain
                    if cfg not in bucket:
                        bucket.append(cfg)
    (tmp_path / "tiles.json").write_text(json.dumps({"plain": plain, "grouped": grouped}))
    (tmp_path / "script.py").write_text(INTERPRETED)
    r = run_py(f"import runpy, sys; sys.argv = ['x', {str(tmp_path / 'tiles.json')!r}]; "
               f"runpy.run_path({str(tmp_path / 'script.py')!r}, run_name='__main__')",
               env_extra={"TRITON_INTERPRET": "1", "OPENBLAS_NUM_THREADS": "1"}, timeout=600)
    assert r.returncode == 0 and "interpreted-ok" in r.stdout, r.stderr[-3000:]
