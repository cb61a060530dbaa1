"""GPU tier for the layouts of issue 13, kernel by kernel: head groups that do not divide the
64-row attention tile, odd vocabularies, YaRN cos/sin. Each kernel vs a float64 evaluation
(tolerance) and its invariances, bitwise (``test_kernels_gpu.py`` style).

Chain: attention for G = 3, 5, 8, 12 (and Coder-480B's 96/8): paged == contiguous, decode ==
prefill == chunked prefill (one program and split-KV up to a 262144-token bound), a sequence
alone == in a ragged batch, a TP rank's heads (split or replicated KV) == those heads of the
full launch, long-context decode == prefill -> token log-probs for V = 3001 and 151669: batch-
invariant, padded (NaN padding) == unpadded, vocab-parallel 2/4/8 simulated == one process, the
sampler's report == token_logprobs -> YaRN cos/sin: batch-invariant, close to float64 up to
position 262143.
"""

import math

import pytest
import torch
from true_on_policy.kernels.attention import attention, attention_reference, contiguous_layout
from true_on_policy.kernels.logprobs import (
    SHARDS,
    finish,
    shard_size,
    shard_stats,
    temperatures,
    token_logprobs,
    token_z,
)
from true_on_policy.kernels.rope import apply_rope, cos_sin, rope_scaling, yarn_inv_freq
from true_on_policy.kernels.sampling import sample

pytestmark = pytest.mark.gpu
COUNTS = [1, 2, 3, 7, 16, 63, 64, 65, 255, 256, 257, 1024]


def _gen(seed):
    return torch.Generator(device="cuda").manual_seed(seed)


def _randn(g, *shape, scale=1.0):
    return (torch.randn(*shape, device="cuda", generator=g) * scale).bfloat16()


def _same(a, b, what):
    if not torch.equal(a, b):
        d = (a.float() - b.float()).abs()
        raise AssertionError(f"{what}: max|d|={d.nan_to_num(float('inf')).max().item()} "
                             f"differing={int((a != b).sum())}")


def _cuda(*values):
    return (torch.tensor([v], device="cuda") for v in values)


@pytest.mark.parametrize("hq,hkv,d", [(6, 2, 64), (5, 1, 128), (12, 1, 128), (8, 1, 128), (96, 8, 128)])
def test_attention_any_head_group(hq, hkv, d, gpu_evidence):
    g = _gen(hq * 1000 + d)
    G, L = hq // hkv, 700
    tok = 64 // G
    q, k, v = _randn(g, L, hq, d), _randn(g, L, hkv, d), _randn(g, L, hkv, d)
    kv, st, ln, p0 = contiguous_layout(1, L, "cuda")
    full = attention(q, k, v, kv, st, ln, p0, L)
    ref = attention_reference(q.double(), k.double(), v.double(), kv, st, ln, p0)
    rel = ((full.double() - ref).norm() / ref.norm()).item()
    assert rel < 1e-2, rel
    pool = L + 50
    perm = torch.randperm(pool, device="cuda", generator=g)[:L]
    kb, vb = _randn(g, pool, hkv, d), _randn(g, pool, hkv, d)
    kb[perm], vb[perm] = k, v
    table = perm.int()[None].contiguous()
    _same(attention(q, kb, vb, table, st, ln, p0, L), full, "paged == contiguous")
    pos = sorted(p for p in {0, 1, tok - 1, tok, tok + 1, 63, 64, 127, 128, 255, 256, 511, 512, L - 1} if p < L)
    for p in pos:
        _same(attention(q[p:p + 1].clone(), kb, vb, table, *_cuda(0, 1, p), 1)[0], full[p], f"decode at {p}")
    ptens = torch.tensor(pos, device="cuda")
    tables = table.expand(len(pos), L).contiguous()
    for mk in (None, L, 4096, 262144):
        _same(attention(q[pos].clone(), kb, vb, tables, None, None, None, 1, max_kv_len=mk, seq_lens=ptens + 1),
              full[pos], f"decode form (max_kv_len={mk})")
    for pre in sorted(p for p in {1, tok, tok + 1, 2 * tok + 1, 64, 200, 511} if p < L):
        for mk in (None, L):
            rest = attention(q[pre:].clone(), kb, vb, table, *_cuda(0, L - pre, pre), L - pre, max_kv_len=mk)
            _same(rest, full[pre:], f"chunked prefill after {pre} (max_kv_len={mk})")
    n0 = 3 * tok + 2  # a short sequence first: the long one's tiles start mid-way in q
    both = attention(torch.cat([q[:n0], q]), kb, vb, torch.cat([table, table]),
                     torch.tensor([0, n0], device="cuda"), torch.tensor([n0, L], device="cuda"),
                     torch.zeros(2, dtype=torch.long, device="cuda"), L)
    _same(both[:n0], full[:n0], "short sequence in a ragged batch")
    _same(both[n0:], full, "long sequence in a ragged batch")
    shards = []
    for tp in (2, 4, 8):  # SGLang's per-rank heads: Hq/tp query heads, KV split or replicated
        if hq % tp:
            continue
        n_q, n_kv = hq // tp, max(1, hkv // tp)
        for rank in range(tp):
            kv0 = rank // (tp // hkv) if tp >= hkv else rank * n_kv
            got = attention(q[:, rank * n_q:(rank + 1) * n_q].contiguous(), k[:, kv0:kv0 + n_kv].contiguous(),
                            v[:, kv0:kv0 + n_kv].contiguous(), kv, st, ln, p0, L)
            _same(got, full[:, rank * n_q:(rank + 1) * n_q], f"TP{tp} rank {rank} (G_local={n_q // n_kv})")
        shards.append(tp)
    gpu_evidence.append({"test": f"attention_group{G}_{hq}q{hkv}kv_d{d}", "rel_err_vs_f64": rel,
                         "decode_positions": pos, "split_kv_max_kv_len": [L, 4096, 262144], "tp_shards": shards})


def test_attention_long_context_decode_group12(gpu_evidence):
    """Coder-480B's TP8 rank (12 query heads, 1 KV head, d 128), a 20000-token sequence: decode at
    block/segment edges == the prefill row, one program and split over a 262144-token bound."""
    g = _gen(20000)
    hq, hkv, d, L = 12, 1, 128, 20000
    q, k, v = _randn(g, L, hq, d), _randn(g, L, hkv, d), _randn(g, L, hkv, d)
    kv, st, ln, p0 = contiguous_layout(1, L, "cuda")
    full = attention(q, k, v, kv, st, ln, p0, L)
    assert torch.isfinite(full.float()).all()
    pos = [0, 127, 128, 8191, 8192, 16383, 16384, L - 1]
    ptens = torch.tensor(pos, device="cuda")
    for mk in (None, L, 262144):
        _same(attention(q[pos].clone(), k, v, kv.expand(len(pos), L).contiguous(), None, None, None, 1, max_kv_len=mk,
                        seq_lens=ptens + 1), full[pos], f"long decode (max_kv_len={mk})")
    rest = attention(q[L - 300:].clone(), k, v, kv, *_cuda(0, 300, L - 300), 300, max_kv_len=262144)
    _same(rest, full[L - 300:], "chunked prefill after 19700")
    gpu_evidence.append({"test": "attention_long_context_group12", "tokens": L, "decode_positions": pos})


@pytest.mark.parametrize("vocab,rows", [(3001, 4097), (151669, 1024)])
def test_token_logprobs_and_sampler_any_vocab(vocab, rows, gpu_evidence):
    g = _gen(vocab)
    logits = torch.randn(rows, vocab, device="cuda", generator=g) * 3
    tok = torch.randint(0, vocab, (rows,), device="cuda", generator=g)
    temp = torch.rand(rows, device="cuda", generator=g) + 0.5
    lp = token_logprobs(logits, tok, temp)
    ref = torch.log_softmax(logits.double() / temp.double()[:, None], -1).gather(-1, tok[:, None])[:, 0]
    err = (lp.double() - ref).abs().max().item()
    assert err < 2e-5, err
    for n in (n for n in COUNTS if n <= rows):
        _same(token_logprobs(logits[:n].clone(), tok[:n].clone(), temp[:n]), lp[:n], f"rows={n}")
    S = shard_size(vocab)
    padded = torch.full((rows, 8 * S + 64), float("nan"), device="cuda")
    padded[:, :vocab] = logits
    _same(token_logprobs(padded, tok, temp, vocab=vocab), lp, "padded (NaN padding) == unpadded")
    _same(token_logprobs(padded[:, :vocab], tok, temp), lp, "strided view == contiguous")
    z = token_z(logits, tok, temperatures(temp, rows, "cuda"))
    for t in (2, 4, 8):
        w = SHARDS // t * S
        st = torch.cat([shard_stats(padded[:, r * w:(r + 1) * w].contiguous(), temp, SHARDS // t, S,
                                    min(max(vocab - r * w, 0), w)) for r in range(t)], 1)
        _same(finish(st, z), lp, f"vocab TP={t} over the padded vocabulary")
    seeds, positions = torch.arange(rows, device="cuda") * 31 + 7, torch.arange(rows, device="cuda") % 977
    ids, slp, _ = sample(logits, temp, seeds, positions)
    _same(slp, token_logprobs(logits, ids, temp), "sampler report == token_logprobs")
    for n in (1, 7, 65):
        i_n, l_n, _ = sample(logits[:n].clone(), temp[:n], seeds[:n], positions[:n])
        _same(i_n, ids[:n], f"sampler ids rows={n}")
        _same(l_n, slp[:n], f"sampler log-probs rows={n}")
    i_s, l_s, _ = sample(padded[:, :vocab], temp, seeds, positions)
    _same(i_s, ids, "sampler on SGLang's sliced (strided) logits")
    gpu_evidence.append({"test": f"token_logprobs_vocab{vocab}", "max_abs_vs_f64": err, "batch_invariant_counts": COUNTS,
                         "vocab_tp_simulated_padded": [2, 4, 8], "sampler_report_bitwise": True})


def test_rope_yarn(gpu_evidence):
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "rope_theta": 1e6}
    y, d = rope_scaling(rope), 128
    pos = torch.arange(0, 262144, 61, device="cuda")
    c, s = cos_sin(pos, d, 1e6, y)
    for n in COUNTS:
        cn, sn = cos_sin(pos[:n].clone(), d, 1e6, y)
        _same(cn, c[:n], f"yarn cos rows={n}")
        _same(sn, s[:n], f"yarn sin rows={n}")
    inv = yarn_inv_freq(d, 1e6, y, "cuda")
    torch.testing.assert_close(inv.cpu(), yarn_inv_freq(d, 1e6, y), rtol=1e-6, atol=0)  # pow: device vs CPU ulps
    small = pos[pos < 4096]  # phase error of fp32 positions x inv_freq grows with the position
    f = small.double()[:, None] * inv.double()[None]
    torch.testing.assert_close(c[:small.shape[0]].double(), f.cos() * y.attention_factor, rtol=0, atol=2e-3)
    assert math.isclose(y.attention_factor, 0.1 * math.log(4.0) + 1.0)
    g = _gen(3)
    x = _randn(g, pos.shape[0], 8, d)
    out = apply_rope(x, c, s)
    for n in (1, 65, 1000):
        _same(apply_rope(x[:n].clone(), c[:n], s[:n]), out[:n], f"yarn apply rows={n}")
    gpu_evidence.append({"test": "rope_yarn_d128_factor4", "positions_to": 262143, "batch_invariant_counts": COUNTS})
