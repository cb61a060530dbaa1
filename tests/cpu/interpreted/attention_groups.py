"""Interpreted: attention for head groups G = Hq/Hkv that do not divide the 64-row tile (3, 5, 12;
Qwen3-Coder-480B has 96/8 heads, a TP shard with a replicated KV head has Hq/tp : 1), bitwise:
decode == prefill == chunked prefill, split-KV == one program, a sequence alone == in a ragged
batch, paged == contiguous, a candidate launch tile (fewer rows, any split, the nested or the flat
loop) == the fixed tile, a
decode tile choice installed as at start-up is taken and keeps the bits; a prefill whose split state would
pass SPLIT_STATE_BYTES launches unsplit, with the same bits; the kernel vs the
reference within tolerance; D outside {64, 128}, G > 64 and Hq not a multiple of Hkv refused."""
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, "tests")  # run with the checkout as cwd (see test_kernels_interpret.py)
from helpers import expect_value_errors  # noqa: E402
from true_on_policy.kernels import attention as A  # noqa: E402
from true_on_policy.kernels.attention import _rows, attention, attention_reference, candidate_tiles, contiguous_layout  # noqa: E402

g = torch.Generator().manual_seed(13)


def one(a):
    return torch.tensor([a])


for hq, hkv, d, L in ((6, 2, 64, 150), (5, 1, 64, 140), (12, 1, 128, 133)):
    G = hq // hkv
    tok = 64 // G  # query tokens per tile: 21, 12, 5 (rows 63, 60..63, 60..63 masked)
    q = torch.randn(L, hq, d, generator=g).bfloat16()
    k, v = (torch.randn(L, hkv, d, generator=g).bfloat16() for _ in range(2))
    kv, st, ln, p0 = contiguous_layout(1, L)
    full = attention(q, k, v, kv, st, ln, p0, L)
    ref = attention_reference(q, k, v, kv, st, ln, p0)
    torch.testing.assert_close(full.float(), ref.float(), rtol=2e-2, atol=2e-2)
    perm = torch.randperm(L + 9, generator=g)[:L]  # a paged pool with holes
    kb, vb = torch.randn(L + 9, hkv, d, generator=g).bfloat16(), torch.randn(L + 9, hkv, d, generator=g).bfloat16()
    kb[perm], vb[perm] = k, v
    table = perm.int()[None]
    assert torch.equal(attention(q, kb, vb, table, st, ln, p0, L), full), (G, "paged")
    # decode steps across tile edges (multiples of tok), 64-key blocks and the 128-key segment
    for p in sorted({0, 1, tok - 1, tok, tok + 1, 63, 64, 127, 128, L - 1}):
        d1 = attention(q[p:p + 1].clone(), kb, vb, table, one(0), one(1), one(p), 1)
        assert torch.equal(d1[0], full[p]), (G, "decode", p)
    pos = [0, tok, 64, 128, L - 1]
    for mk in (None, L, 1000):  # the decode form, one program or split-KV
        dec = attention(q[pos].clone(), kb, vb, table.expand(len(pos), L).contiguous(), None, None, None, 1,
                        max_kv_len=mk, seq_lens=torch.tensor(pos) + 1)
        assert torch.equal(dec, full[pos]), (G, "decode form", mk)
    for bm in sorted({t["BLOCK_M"] for t in candidate_tiles(G)}):  # candidate tiles: fewer rows, the same rows' math
        for split in (1, 2, 3):
            for loop in ({}, {"loop": "flat"}):  # the nested loop and the flat one
                tiled = attention(q[pos].clone(), kb, vb, table.expand(len(pos), L).contiguous(), None, None, None, 1,
                                  max_kv_len=L, seq_lens=torch.tensor(pos) + 1,
                                  tile={"BLOCK_M": bm, "split": split, **loop})
                assert torch.equal(tiled, full[pos]), (G, "decode tile", bm, split, loop)
    # a choice installed as choose_decode_tiles does: the decode form takes it (a candidate 16-row tile at
    # batches up to 2, the fixed tile above) and gives the same bits; a layout without a choice is untouched
    small = next(t for t in candidate_tiles(G) if t["BLOCK_M"] < 64) if G <= 32 else None
    A.set_decode_tiles(hq, hkv, d, {2: small, 4: None})
    assert A.decode_tile_for(hq, hkv, d, 1) == small and A.decode_tile_for(hq, hkv, d, 3) is None
    assert A.decode_tile_for(hq, hkv, d, 99) is None and A.decode_tile_for(hq + hkv, hkv, d, 1) is None
    launched = []
    kernel_run = A._attention_kernel.run
    A._attention_kernel.run = lambda *a, _l=launched, _r=kernel_run, **kw: (_l.append(kw["BLOCK_M"]), _r(*a, **kw))[1]
    try:
        for n in (1, 2, 3):
            chosen = attention(q[pos[:n]].clone(), kb, vb, table.expand(n, L).contiguous(), None, None, None, 1,
                               max_kv_len=L, seq_lens=torch.tensor(pos[:n]) + 1)
            assert torch.equal(chosen, full[pos[:n]]), (G, "chosen decode tile", n)
    finally:
        A._attention_kernel.run = kernel_run
        A.clear_decode_tiles()
    assert launched == [small["BLOCK_M"], small["BLOCK_M"], 64], (G, launched)
    bm = min(t["BLOCK_M"] for t in candidate_tiles(G))  # a chunked prefill in the fewest rows a tile may have
    rest = attention(q[tok:].clone(), kb, vb, table, one(0), one(L - tok), one(tok), L - tok, tile={"BLOCK_M": bm})
    assert torch.equal(rest, full[tok:]), (G, "chunked tile", bm)
    for pre in (1, tok, tok + 2, 64, 100):  # chunked prefill after a cached prefix: other tile membership
        for mk in (None, L):
            rest = attention(q[pre:].clone(), kb, vb, table, one(0), one(L - pre), one(pre), L - pre, max_kv_len=mk)
            assert torch.equal(rest, full[pre:]), (G, "chunked", pre, mk)
    # a prefill whose split state would pass SPLIT_STATE_BYTES launches unsplit, with the same bits
    kept, rule_split, cap = [], A.prefill_split, A.SPLIT_STATE_BYTES

    def recorded(*a, _kept=kept, _rule=rule_split):
        _kept.append(_rule(*a))
        return _kept[-1]

    A.prefill_split = recorded
    try:
        for A.SPLIT_STATE_BYTES in (cap, 0):
            rest = attention(q[100:].clone(), kb, vb, table, one(0), one(L - 100), one(100), L - 100, max_kv_len=L)
            assert torch.equal(rest, full[100:]), (G, "prefill split state", A.SPLIT_STATE_BYTES)
    finally:
        A.prefill_split, A.SPLIT_STATE_BYTES = rule_split, cap
    assert kept[0] > 1 and kept[1] == 1, (G, kept)
    # batch invariance: a short and the long sequence in one ragged launch == each alone
    n0 = tok + 3
    q2 = torch.cat([q[:n0], q])
    both = attention(q2, kb, vb, torch.cat([table, table]), torch.tensor([0, n0]), torch.tensor([n0, L]),
                     torch.tensor([0, 0]), L)
    assert torch.equal(both[:n0], full[:n0]) and torch.equal(both[n0:], full), (G, "batch")
    # a TP rank's shard (query heads of one KV head, SGLang's layout) == those heads of the full launch
    if hkv > 1:  # KV heads partitioned: rank 1 of 2 holds KV head 1 and its G query heads
        rank = attention(q[:, G:2 * G].contiguous(), k[:, 1:2].contiguous(), v[:, 1:2].contiguous(), kv, st, ln, p0, L)
        assert torch.equal(rank, full[:, G:2 * G]), (G, "tp shard")
    if G % 2 == 0:  # KV head replicated (tp > Hkv): rank 1 of 2 holds query heads G/2..G-1 and KV head 0
        rank = attention(q[:, G // 2:G].contiguous(), k[:, :1].contiguous(), v[:, :1].contiguous(), kv, st, ln, p0, L)
        assert torch.equal(rank, full[:, G // 2:G]), (G, "replicated KV shard")



@triton.jit
def _owners(OUT, ZERO, Q_LEN, G: tl.constexpr, BLOCK_M: tl.constexpr, HQ: tl.constexpr):
    """The (token * HQ + head) each row of tile (tile, kvh) would store, -1 for a masked row."""
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    n_q, q_rows, head, row_ok, pos, last = _rows(0, tile, kvh, ZERO, Q_LEN, ZERO, Q_LEN, G, BLOCK_M, False)
    r = tl.arange(0, BLOCK_M)
    tl.store(OUT + (tile * tl.num_programs(1) + kvh) * BLOCK_M + r, tl.where(row_ok, q_rows * HQ + head, -1))


for G, BM in ((1, 64), (3, 64), (5, 64), (8, 64), (12, 64), (64, 64), (4, 16), (12, 16), (16, 16), (20, 32)):
    n = 200  # every query (token, head) is stored by exactly one tile row: a row stored twice would be
    tiles = triton.cdiv(n, BM // G)  # a write race on a GPU that the interpreter's program order hides
    rows = torch.empty(tiles, 2, BM, dtype=torch.int64)
    _owners[(tiles, 2)](rows, torch.zeros(1, dtype=torch.int32), torch.tensor([n], dtype=torch.int32), G=G, BLOCK_M=BM,
                        HQ=2 * G)
    owned = torch.bincount(rows[rows >= 0], minlength=n * 2 * G)
    assert owned.shape[0] == n * 2 * G and bool((owned == 1).all()), (G, BM, "rows owned by more or fewer than one tile")

x = torch.randn(4, 2, 96).bfloat16()
kv, st, ln, p0 = contiguous_layout(1, 4)
expect_value_errors(
    lambda: attention(torch.randn(4, 3, 96).bfloat16(), x[:, :1].contiguous(), x[:, :1].contiguous(), kv, st, ln, p0, 4),
    lambda: attention(torch.randn(4, 6, 32).bfloat16(), *(torch.randn(4, 2, 32).bfloat16(),) * 2, kv, st, ln, p0, 4),
    lambda: attention(torch.randn(4, 3, 64).bfloat16(), *(torch.randn(4, 2, 64).bfloat16(),) * 2, kv, st, ln, p0, 4),
    lambda: attention(torch.randn(4, 96, 64).bfloat16(), *(torch.randn(4, 1, 64).bfloat16(),) * 2, kv, st, ln, p0, 4))
q6, k2 = torch.randn(4, 6, 64).bfloat16(), torch.randn(4, 2, 64).bfloat16()
expect_value_errors(*(lambda t=t: attention(q6, k2, k2, kv, st, ln, p0, 4, tile=t) for t in (
    {"BLOCK_M": 8}, {"BLOCK_M": 128}, {"num_warps": 3}, {"num_stages": 0}, {"split": 0}, {"tiles": 2})))
try:  # every problem of a tile in one message
    attention(torch.randn(4, 64, 64).bfloat16(), k2[:, :1].contiguous(), k2[:, :1].contiguous(), kv, st, ln, p0, 4,
              tile={"BLOCK_M": 16, "num_warps": 3, "split": True})
except ValueError as e:
    assert all(w in str(e) for w in ("BLOCK_M 16", "head group 64", "num_warps 3", "split True")), e
else:
    raise AssertionError("a tile with three problems was accepted")
assert all(t["BLOCK_M"] >= 12 for t in candidate_tiles(12)) and {t["BLOCK_M"] for t in candidate_tiles(4)} == {16, 32, 64}
assert dict(BLOCK_M=64, num_warps=4, num_stages=3) in candidate_tiles(8)  # the fixed tile is a candidate
try:
    attention(torch.randn(4, 3, 96).bfloat16(), x[:, :1].contiguous(), x[:, :1].contiguous(), kv, st, ln, p0, 4)
except ValueError as e:
    assert "head_dim 96" in str(e) and "64 and 128" in str(e), e
print("interpreted-ok")
