"""Interpreted: attention through an index table (paged == contiguous, decode == prefill ==
chunked prefill, across 64-key block and 128-key segment boundaries; split-KV == one program;
the decode form; the flat loop in both forms; a prefill tile installed per head layout), RoPE apply invariance, q and k in one launch with
the K/V write and the QK-norm."""
import sys

import torch
from true_on_policy.kernels.attention import attention, attention_reference, contiguous_layout
from true_on_policy.kernels.rmsnorm import rmsnorm_heads
from true_on_policy.kernels.rope import (
    apply_rope,
    apply_rope_qk,
    apply_rope_qk_reference,
    apply_rope_reference,
    cos_sin,
)

g = torch.Generator().manual_seed(0)
for hq, hkv, d in ((4, 2, 64), (8, 2, 128)):
    L = 150
    q = torch.randn(L, hq, d, generator=g).bfloat16()
    k, v = (torch.randn(L, hkv, d, generator=g).bfloat16() for _ in range(2))
    kv, st, ln, p0 = contiguous_layout(1, L)
    full = attention(q, k, v, kv, st, ln, p0, L)
    torch.testing.assert_close(full.float(), attention_reference(q, k, v, kv, st, ln, p0).float(), rtol=2e-2, atol=2e-2)
    perm = torch.randperm(L + 7, generator=g)[:L]  # a paged pool with holes
    kb, vb = torch.randn(L + 7, hkv, d).bfloat16(), torch.randn(L + 7, hkv, d).bfloat16()
    kb[perm], vb[perm] = k, v
    table = perm.int()[None]
    assert torch.equal(attention(q, kb, vb, table, st, ln, p0, L), full)
    for p in (0, 1, 63, 64, 65, 127, 128, 149):  # one decode step at position p
        one = attention(q[p:p + 1].clone(), kb, vb, table, *(torch.tensor([a]) for a in (0, 1, p)), 1)
        assert torch.equal(one[0], full[p]), (hq, p)
    for pre in (1, 64, 70):  # chunked prefill after a cached prefix of `pre` tokens
        rest = attention(q[pre:].clone(), kb, vb, table, *(torch.tensor([a]) for a in (0, L - pre, pre)), L - pre)
        assert torch.equal(rest, full[pre:]), (hq, pre)
    # two sequences in one launch (ragged), second one right after the first in q
    q2 = torch.cat([q[:40], q[:L]])
    kv2 = torch.stack([table[0], table[0]])
    both = attention(q2, kb, vb, kv2, torch.tensor([0, 40]), torch.tensor([40, L]), torch.tensor([0, 0]), L)
    assert torch.equal(both[:40], full[:40]) and torch.equal(both[40:], full)
    # the same two sequences through a row indirection into a larger pool (SGLang's req_to_token)
    pool_rows = torch.zeros(5, L + 3, dtype=torch.int32)
    pool_rows[3, :L], pool_rows[1, :L] = table[0], table[0]
    rows = attention(q2, kb, vb, pool_rows, torch.tensor([0, 40]), torch.tensor([40, L]), torch.tensor([0, 0]), L,
                     kv_rows=torch.tensor([3, 1]))
    assert torch.equal(rows, both), hq
    c, s = cos_sin(torch.arange(L), d, 1e6)
    r = apply_rope(q, c, s)
    torch.testing.assert_close(r.float(), apply_rope_reference(q, c, s).float(), rtol=2e-2, atol=4e-2)
    assert torch.equal(apply_rope(q[5:9].clone(), c[5:9], s[5:9]), r[5:9])
    # q and k in one launch: each bitwise apply_rope; the K/V write stores the rotated k and v at loc
    qkv = torch.cat([q.reshape(L, -1), k.reshape(L, -1), v.reshape(L, -1)], -1)
    qs, ks, vs = qkv.split([hq * d, hkv * d, hkv * d], -1)
    kc, vc = torch.zeros(L + 9, hkv * d).bfloat16(), torch.zeros(L + 9, hkv * d).bfloat16()
    loc = torch.randperm(L + 9, generator=g)[:L]
    qo, ko = apply_rope_qk(qs, ks, c, s, d, (vs, kc, vc, loc))
    assert torch.equal(qo.view(L, hq, d), r) and torch.equal(ko.view(L, hkv, d), apply_rope(k, c, s))
    assert torch.equal(kc[loc], ko) and torch.equal(vc[loc], vs) and not kc[~torch.isin(torch.arange(L + 9), loc)].any()
    assert all(torch.equal(a, b) for a, b in zip(apply_rope_qk(qs, ks, c, s, d), (qo, ko), strict=True))
    kr_c, vr_c = torch.zeros_like(kc), torch.zeros_like(vc)  # the torch reference: the interpreter rounds by truncation
    qr, kr = apply_rope_qk_reference(qs, ks, c, s, d, (vs, kr_c, vr_c, loc))
    torch.testing.assert_close(qo.float(), qr.float(), rtol=2e-2, atol=4e-2)
    torch.testing.assert_close(ko.float(), kr.float(), rtol=2e-2, atol=4e-2)
    assert torch.equal(kr_c[loc], kr) and torch.equal(vr_c, vc)
    # with the QK-norm in the same launch: rmsnorm_heads of q and k, then the rotation and write above
    qw, kw = (1 + 0.1 * torch.randn(d, generator=g)).bfloat16(), (1 + 0.1 * torch.randn(d, generator=g)).bfloat16()
    kn_c, vn_c = torch.zeros_like(kc), torch.zeros_like(vc)
    qno, kno = apply_rope_qk(qs, ks, c, s, d, (vs, kn_c, vn_c, loc), (qw, kw, 1e-6, 1e-5))
    qn, kn = rmsnorm_heads(qs, qw, 1e-6).view(L, -1), rmsnorm_heads(ks, kw, 1e-5).view(L, -1)
    assert all(torch.equal(a, b) for a, b in zip((qno, kno), apply_rope_qk(qn, kn, c, s, d), strict=True))
    assert torch.equal(kn_c[loc], kno) and torch.equal(vn_c, vc)
    qnr, knr = apply_rope_qk_reference(qs, ks, c, s, d, None, (qw, kw, 1e-6, 1e-5))
    torch.testing.assert_close(qno.float(), qnr.float(), rtol=2e-2, atol=6e-2)
    torch.testing.assert_close(kno.float(), knr.float(), rtol=2e-2, atol=6e-2)
# across segments: split-KV (max_kv_len given, few programs) and the decode form give the same bits
hq, hkv, d, L = 4, 2, 64, 530
q = torch.randn(L, hq, d, generator=g).bfloat16()
k, v = (torch.randn(L, hkv, d, generator=g).bfloat16() for _ in range(2))
kv, st, ln, p0 = contiguous_layout(1, L)
full = attention(q, k, v, kv, st, ln, p0, L)
torch.testing.assert_close(full.float(), attention_reference(q, k, v, kv, st, ln, p0).float(), rtol=2e-2, atol=2e-2)
pos = [0, 255, 256, 257, 511, 512, 529]
for mk in (None, L, 1000):
    dec = attention(q[pos].clone(), k, v, kv.expand(len(pos), L).contiguous(), None, None, None, 1, max_kv_len=mk,
                    seq_lens=torch.tensor(pos) + 1)
    assert torch.equal(dec, full[pos]), mk
    one = attention(q[257:258].clone(), k, v, kv, *(torch.tensor([a]) for a in (0, 1, 257)), 1, max_kv_len=mk)
    assert torch.equal(one[0], full[257]), mk
# the flat loop over five segments: unsplit, and split so that programs run 0, 1 or 2 segments round-robin
for split in (None, 1, 2, 3, 8):
    tile = {"BLOCK_M": 16, "num_warps": 1, "loop": "flat", **({} if split is None else {"split": split})}
    dec = attention(q[pos].clone(), k, v, kv.expand(len(pos), L).contiguous(), None, None, None, 1, max_kv_len=L,
                    seq_lens=torch.tensor(pos) + 1, tile=tile)
    assert torch.equal(dec, full[pos]), ("flat loop", split)
rest = attention(q[300:].clone(), k, v, kv, *(torch.tensor([a]) for a in (0, L - 300, 300)), L - 300, max_kv_len=L)
assert torch.equal(rest, full[300:])
# the prefill form in the flat loop: a whole prefill, a chunk after a cached prefix (unsplit and split over 1, 2 or 3
# programs), two ragged sequences, in the fixed tile and a one-warp tile, and as set_prefill_loop installs it
flat_tiles = ({"loop": "flat"}, {"BLOCK_M": 16, "num_warps": 1, "num_stages": 2, "loop": "flat"})
for tile in flat_tiles:
    assert torch.equal(attention(q, k, v, kv, st, ln, p0, L, tile=tile), full), ("flat prefill", tile)
    for split in (None, 1, 2, 3):
        t = dict(tile, **({} if split is None else {"split": split}))
        chunk = attention(q[300:].clone(), k, v, kv, *(torch.tensor([a]) for a in (0, L - 300, 300)), L - 300,
                          max_kv_len=L, tile=t)
        assert torch.equal(chunk, full[300:]), ("flat chunk", t)
    q2 = torch.cat([q[:200], q])
    two = attention(q2, k, v, torch.stack([kv[0], kv[0]]), torch.tensor([0, 200]), torch.tensor([200, L]),
                    torch.tensor([0, 0]), L, tile=tile)
    assert torch.equal(two[:200], full[:200]) and torch.equal(two[200:], full), ("flat ragged", tile)
attention_module = sys.modules["true_on_policy.kernels.attention"]
attention_module.set_prefill_loop("flat")
try:
    assert attention_module.prefill_loop() == "flat"
    assert torch.equal(attention(q, k, v, kv, st, ln, p0, L), full)
finally:
    attention_module.set_prefill_loop("nested")
# a prefill tile installed per head layout (set_prefill_tile, as choose_prefill_tile installs it): the prefill form
# without a tile launches it, for that layout only, and every candidate gives the default's bits
seen, check = [], attention_module._check_tile
attention_module._check_tile = lambda tile, group: (seen.append(dict(tile)), check(tile, group))[1]
try:
    n = 130  # across a 64-key block and the first 128-key segment
    kv_n, st_n, ln_n, p0_n = contiguous_layout(1, n)
    q_other = torch.randn(n, 2 * hq, d, generator=g).bfloat16()
    for cand in attention_module.prefill_candidates():
        attention_module.set_prefill_tile(hq, hkv, d, cand)
        attention_module.set_prefill_tile(2 * hq, hkv, d, None)  # another layout keeps the loop's default
        seen.clear()
        assert torch.equal(attention(q[:n].clone(), k, v, kv_n, st_n, ln_n, p0_n, n), full[:n]), ("chosen", cand)
        assert seen == [cand], (seen, cand)
        seen.clear()
        attention(q_other, k, v, kv_n, st_n, ln_n, p0_n, n)
        assert seen == [], seen
finally:
    attention_module._check_tile = check
    attention_module.clear_prefill_tiles()
short = attention(q[-1:].clone(), k, v, kv, None, None, None, 1, max_kv_len=300, seq_lens=torch.tensor([L]))
assert short.isnan().all(), "a sequence longer than max_kv_len must come out NaN"
try:
    attention(torch.randn(3, 3, 64).bfloat16(), k, v, kv, st, ln, p0, 3)
except ValueError:
    pass
else:
    raise AssertionError("bad head layout accepted")
print("interpreted-ok")
