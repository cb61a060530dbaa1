"""GPU tier for kernels/: each Triton kernel vs a float64 evaluation (relative error, tolerance
by dtype) and its invariances, bitwise. Fresh random inputs per case, never zeros.

Chain: kernels batch-invariant (13 token counts) -> column split changes nothing -> TP tree
TP=1 == simulated 2/4/8 -> attention paged == contiguous, decode == prefill == chunked
prefill -> MoE batch-invariant, TP 2/4/8 and EP 2/4 simulated == 1 -> vocab shards == full.
Real two-GPU collectives: ``test_kernels_dist_gpu.py``.
"""

import pytest
import torch
from true_on_policy.kernels.attention import attention, attention_reference, contiguous_layout
from true_on_policy.kernels.logprobs import (
    SHARDS,
    finish,
    shard_stats,
    temperatures,
    token_logprobs,
    token_logprobs_reference,
    token_z,
)
from true_on_policy.kernels.matmul import DOWN_TMA, DOWN_TOKENS, matmul, table_tiles, tree_sum
from true_on_policy.kernels.moe import combine, expert_outputs, moe, moe_reference, route, tp_shard
from true_on_policy.kernels.rmsnorm import rmsnorm, rmsnorm_reference
from true_on_policy.kernels.rope import apply_rope, apply_rope_qk, apply_rope_reference, cos_sin
from true_on_policy.kernels.tree_reduce import row_linear, row_linear_reference

pytestmark = pytest.mark.gpu
COUNTS = [1, 2, 3, 7, 16, 63, 64, 65, 255, 256, 257, 1024, 4097]
REL_TOL = {torch.bfloat16: 1e-2, torch.float32: 1e-5}  # ||out - ref|| / ||ref|| vs float64


def _gen(seed):
    return torch.Generator(device="cuda").manual_seed(seed)


def _randn(g, *shape, scale=1.0):
    return (torch.randn(*shape, device="cuda", generator=g) * scale).bfloat16()


def _rel(out, ref64):
    return ((out.double() - ref64).norm() / ref64.norm()).item()


def _diff(a, b):
    d = (a.float() - b.float()).abs()
    return f"max|d|={d.max().item()} differing={(d > 0).sum().item()}"


def _same(a, b, what):
    assert torch.equal(a, b), f"{what}: {_diff(a, b)}"


@pytest.mark.parametrize("h", [64, 128, 2048])
def test_rmsnorm_residual_form_equals_add_then_norm(h, gpu_evidence):
    """The rollout's fused residual RMSNorm == the trainer's bf16 ``x + residual`` followed by the
    plain RMSNorm, bit for bit, in both forms (the tile form below TILE_H, the row form above)."""
    g = _gen(h + 7)
    x, r = _randn(g, 4097, h), _randn(g, 4097, h)
    w = (1 + 0.1 * torch.randn(h, device="cuda", generator=g)).bfloat16()
    out, s = rmsnorm(x, w, 1e-6, r)
    _same(s, x + r, f"h={h} residual sum")
    _same(out, rmsnorm(x + r, w, 1e-6), f"h={h} norm")
    gpu_evidence.append({"test": f"rmsnorm_h{h}_residual_form_eq_add_then_norm", "bitwise": True})


@pytest.mark.parametrize("h", [64, 128, 2048])
def test_rmsnorm(h, gpu_evidence):
    g = _gen(h)
    x, r = _randn(g, 4097, h), _randn(g, 4097, h)
    w = (1 + 0.1 * torch.randn(h, device="cuda", generator=g)).bfloat16()
    out, s = rmsnorm(x, w, 1e-6, r)
    ref, rs = rmsnorm_reference(x, w, 1e-6, r)
    _same(s, rs, "bf16 residual add")
    s64 = s.double()
    rel = _rel(out, w.double() * s64 * torch.rsqrt(s64.pow(2).mean(-1, keepdim=True) + 1e-6))
    assert rel < REL_TOL[torch.bfloat16], rel
    for n in COUNTS:
        o_n, s_n = rmsnorm(x[:n].clone(), w, 1e-6, r[:n].clone())
        _same(o_n, out[:n], f"rows={n}")
        _same(s_n, s[:n], f"residual rows={n}")
    gpu_evidence.append({"test": f"rmsnorm_h{h}", "rel_err_vs_f64": rel, "exact_vs_torch_reference":
                         (out == ref).double().mean().item(), "batch_invariant_counts": COUNTS})


@pytest.mark.parametrize("n_out,k,out_dtype", [(5120, 2048, torch.bfloat16), (2048, 4096, torch.bfloat16),
                                               (151936, 2048, torch.float32),
                                               (136, 2048, torch.bfloat16), (1000, 640, torch.float32)])
def test_matmul_tma_equals_pointer_path(n_out, k, out_dtype, gpu_evidence):
    """The TMA fast path computes the same elements as the pointer-load kernel, bit for bit, so
    which one a shape takes (alignment, GPU generation, TP shard width) never changes a result."""
    from true_on_policy.kernels.matmul import COLUMN, TMA, _launch, _launch_tma, _tma_ok, table_tiles

    g = _gen(n_out + k + 1)
    x, w = _randn(g, 4097, k), _randn(g, n_out, k, scale=0.05)
    for rows in (1, 65, 4097):
        xr = x[:rows].clone()
        b = _launch(xr, w, torch.empty(rows, n_out, dtype=out_dtype, device="cuda"), None, None, rows, 1, COLUMN)
        for role, tiles in TMA.items():
            for cfg in table_tiles(tiles):  # a table's tiles at every row count, not only at their own
                a = _launch_tma(xr, w, torch.empty(rows, n_out, dtype=out_dtype, device="cuda"), cfg)
                _same(a, b, f"TMA ({role} tiles {cfg}) == pointer, rows={rows}")
        _same(matmul(xr, w, out_dtype, role="lm_head"), b, f"matmul(role=lm_head), rows={rows}")
    assert _tma_ok(x, w, a)
    gpu_evidence.append({"test": f"matmul_tma_eq_pointer_{n_out}x{k}_{out_dtype}", "rows": [1, 65, 4097]})


@pytest.mark.parametrize("n_out,k", [(768, 2048), (128, 2048)])
def test_matmul_batch_and_column_invariance(n_out, k, gpu_evidence):
    g = _gen(n_out + k)
    x, w = _randn(g, 4097, k), _randn(g, n_out, k, scale=0.05)
    y = matmul(x, w)
    rel = _rel(y, x.double() @ w.double().T)
    assert rel < REL_TOL[torch.bfloat16], rel
    for n in COUNTS:
        _same(matmul(x[:n].clone(), w), y[:n], f"rows={n}")
    half = n_out // 2
    _same(matmul(x, w[:half].clone()), y[:, :half], "column shard 0")
    _same(matmul(x, w[half:].clone()), y[:, half:], "column shard 1")
    gpu_evidence.append({"test": f"matmul_{n_out}x{k}", "rel_err_vs_f64": rel, "batch_invariant_counts": COUNTS,
                         "column_split_bitwise": True})


def test_split_planes_of_subtrees_equal_planes(gpu_evidence):
    """``split_matmul(per_plane=2 or 4)`` (each program the subtree of 2 or 4 segments, fewer planes
    written and read back), at each tile of the sweep, == the 8 planes at ROW's tiles, bit for bit,
    at o_proj's shape (fp32 root and bf16 output)."""
    from true_on_policy.kernels.matmul import ROW, split_matmul

    tiles = [ROW, dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3),
             dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4)]
    g = _gen(31)
    w = _randn(g, 2048, 4096, scale=0.02)
    for rows in (1, 256, 4097):
        x = _randn(g, rows, 4096)
        ref = split_matmul(x, w, 8, torch.float32, per_plane=1)
        ref16 = split_matmul(x, w, 8, per_plane=1)
        for pp in (None, 1, 2, 4):  # None: the default (PER_PLANE)
            for cfg in tiles:
                tag = f"rows={rows} per_plane={pp} tile={cfg['BLOCK_M']}x{cfg['BLOCK_N']}"
                _same(split_matmul(x, w, 8, torch.float32, per_plane=pp, cfg=cfg), ref, tag)
                _same(split_matmul(x, w, 8, per_plane=pp, cfg=cfg), ref16, tag + " bf16")
    gpu_evidence.append({"test": "split_planes_of_subtrees_eq_planes", "rows": [1, 256, 4097], "per_plane": [1, 2, 4],
                         "tiles": len(tiles), "bitwise": True})


def test_row_linear_tree_tp_invariance(gpu_evidence):
    g = _gen(11)
    x, w = _randn(g, 4097, 4096), _randn(g, 2048, 4096, scale=0.02)
    full = row_linear(x, w, out_dtype=torch.float32)
    rel = _rel(full, x.double() @ w.double().T)
    assert rel < REL_TOL[torch.float32], rel
    torch.testing.assert_close(full, row_linear_reference(x, w, torch.float32), rtol=1e-5, atol=1e-5)
    for t in (2, 4, 8):
        k = 4096 // t
        roots = [matmul(x[:, r * k:(r + 1) * k].contiguous(), w[:, r * k:(r + 1) * k].contiguous(),
                        out_dtype=torch.float32, segments=8 // t, tree=True) for r in range(t)]
        _same(tree_sum(roots), full, f"TP={t}")
    for n in COUNTS:
        _same(row_linear(x[:n].clone(), w, out_dtype=torch.float32), full[:n], f"rows={n}")
    gpu_evidence.append({"test": "row_linear_tree_4096->2048", "rel_err_vs_f64": rel, "tp_simulated": [2, 4, 8],
                         "batch_invariant_counts": COUNTS})


@pytest.mark.parametrize("hq,hkv,d", [(4, 2, 64), (32, 4, 128)])
def test_attention_prefill_decode_chunked(hq, hkv, d, gpu_evidence):
    g = _gen(hq * d)
    L = 700  # crosses the 64-key blocks and the 128-key segments
    q, k, v = _randn(g, L, hq, d), _randn(g, L, hkv, d), _randn(g, L, hkv, d)
    kv, st, ln, p0 = contiguous_layout(1, L, "cuda")
    full = attention(q, k, v, kv, st, ln, p0, L)
    ref = attention_reference(q.double(), k.double(), v.double(), kv, st, ln, p0)
    rel = _rel(full, ref)
    assert rel < REL_TOL[torch.bfloat16], rel
    pool = L + 50
    perm = torch.randperm(pool, device="cuda", generator=g)[:L]
    kb, vb = _randn(g, pool, hkv, d), _randn(g, pool, hkv, d)
    kb[perm], vb[perm] = k, v
    table = perm.int()[None].contiguous()
    _same(attention(q, kb, vb, table, st, ln, p0, L), full, "paged == contiguous")
    pool_rows = torch.zeros(4, L + 9, dtype=torch.int32, device="cuda")
    pool_rows[2, :L] = table[0]
    _same(attention(q, kb, vb, pool_rows, st, ln, p0, L, kv_rows=torch.tensor([2], device="cuda")), full,
          "row indirection (req_to_token[req_pool_indices]) == gathered table")
    pos = [0, 1, 62, 63, 64, 65, 127, 128, 129, 191, 192, 255, 256, 257, 299, 511, 512, 513, 699]
    # all decode steps in one batch: B sequences sharing the table, one query each; one program
    # per (sequence, KV head), split-KV (max_kv_len) and the decode form (seq_lens)
    tables = table.expand(len(pos), L).contiguous()
    ones = torch.ones(len(pos), dtype=torch.int32, device="cuda")
    ptens = torch.tensor(pos, device="cuda")
    dec = attention(q[pos].clone(), kb, vb, tables, torch.arange(len(pos), device="cuda"), ones, ptens, 1)
    _same(dec, full[pos], "decode == prefill")
    for mk in (L, 4096, 40960):
        _same(attention(q[pos].clone(), kb, vb, tables, None, None, None, 1, max_kv_len=mk, seq_lens=ptens + 1),
              full[pos], f"decode form, split-KV (max_kv_len={mk}) == prefill")
        _same(attention(q[pos].clone(), kb, vb, pool_rows, None, None, None, 1, max_kv_len=mk, seq_lens=ptens + 1,
                        kv_rows=torch.full_like(ptens, 2)), full[pos], f"decode form over req_to_token rows ({mk})")
    for p in (0, 64, 129, 256, 600):
        for mk in (None, L):
            one = attention(q[p:p + 1].clone(), kb, vb, table, *(torch.tensor([a], device="cuda") for a in (0, 1, p)),
                            1, max_kv_len=mk)
            _same(one[0], full[p], f"decode alone at {p} (max_kv_len={mk})")
    for pre in (1, 63, 64, 65, 200, 256, 511, 600):
        for mk in (None, L):
            rest = attention(q[pre:].clone(), kb, vb, table,
                             *(torch.tensor([a], device="cuda") for a in (0, L - pre, pre)), L - pre, max_kv_len=mk)
            _same(rest, full[pre:], f"chunked prefill after {pre} (max_kv_len={mk})")
    short = attention(q[-1:].clone(), kb, vb, table, None, None, None, 1, max_kv_len=300,
                      seq_lens=torch.tensor([L], device="cuda"))
    assert short.isnan().all(), "a split launch with max_kv_len below the length must give NaN"
    gpu_evidence.append({"test": f"attention_{hq}q{hkv}kv_d{d}", "rel_err_vs_f64": rel, "decode_positions": pos,
                         "chunked_prefixes": [1, 63, 64, 65, 200, 256, 511, 600], "paged_equals_contiguous": True,
                         "split_kv_max_kv_len": [L, 4096, 40960]})


@pytest.mark.parametrize("batch", [1, 2, 3, 7, 16, 33, 64, 65, 255])
def test_attention_decode_batch_invariant(batch, gpu_evidence):
    """Qwen3-30B-A3B heads: a sequence's decode output is the same bits at any batch size, split
    or not (the split choice depends on the batch), and equal to its prefill row."""
    g = _gen(batch)
    hq, hkv, d, L = 32, 4, 128, 1100
    kb, vb = _randn(g, L * 2, hkv, d), _randn(g, L * 2, hkv, d)
    table = torch.randperm(L * 2, device="cuda", generator=g)[:L].int()[None].contiguous()
    q = _randn(g, L, hq, d)
    _, st, ln, p0 = contiguous_layout(1, L, "cuda")
    full = attention(q, kb, vb, table, st, ln, p0, L)
    pos = torch.randint(0, L, (batch,), device="cuda", generator=g)
    pos[0] = L - 1
    dec = attention(q[pos].clone(), kb, vb, table.expand(batch, L).contiguous(), None, None, None, 1,
                    max_kv_len=L * 2, seq_lens=pos + 1)
    _same(dec, full[pos], f"decode batch {batch} == prefill rows")
    gpu_evidence.append({"test": f"attention_decode_batch_{batch}", "bitwise_vs_prefill": True})


# the head layouts of benchmarks/geometries.py (a3b48, a22b_h200, a35b_h200, h3072e64k4, h1536e256k6)
# and a TP-2 shard of the 30B-A3B's (16 query heads over 2 KV heads)
TILE_HEADS = [(32, 4), (64, 4), (96, 8), (40, 2), (24, 6), (16, 2)]


@pytest.mark.parametrize("hq,hkv", TILE_HEADS)
def test_attention_tiles_equal_prefill(hq, hkv, gpu_evidence):
    """Every candidate launch tile (``attention.candidate_tiles``: the fixed tile, and one warp over
    fewer rows in other stages), split or not, gives the fixed tile's bits: the decode form of a batch at positions across the
    64-key blocks and 128-key segments == those rows of the fixed tile's prefill; and a chunked
    prefill in the candidate tile == the fixed one's rows. Lists every candidate that differs."""
    from true_on_policy.kernels.attention import candidate_tiles

    g, d, L = _gen(hq * 7 + hkv), 128, 1100
    kb, vb = _randn(g, L * 2, hkv, d), _randn(g, L * 2, hkv, d)
    table = torch.randperm(L * 2, device="cuda", generator=g)[:L].int()[None].contiguous()
    q = _randn(g, L, hq, d)
    _, st, ln, p0 = contiguous_layout(1, L, "cuda")
    full = attention(q, kb, vb, table, st, ln, p0, L)
    pos = torch.tensor([0, 1, 63, 64, 127, 128, 129, 255, 256, 511, 640, 1023, 1024, L - 1], device="cuda")
    tables = table.expand(len(pos), L).contiguous()
    rows = torch.arange(len(pos), device="cuda")  # int64, as SGLang's req_pool_indices
    pre = 129
    outcomes, differ = [], []
    for tile in candidate_tiles(hq // hkv):
        for split in (None, 1, 4):
            t = dict(tile, **({} if split is None else {"split": split}))
            dec = attention(q[pos].clone(), kb, vb, tables, None, None, None, 1, max_kv_len=40960, seq_lens=pos + 1,
                            kv_rows=rows, tile=t)  # as the rollout calls it: req_to_token rows
            same = bool(torch.equal(dec, full[pos]))
            if split is None:
                rest = attention(q[pre:].clone(), kb, vb, table, *(torch.tensor([a], device="cuda") for a in
                                                                   (0, L - pre, pre)), L - pre, tile=tile)
                same = same and bool(torch.equal(rest, full[pre:]))
            outcomes.append({**t, "same_bits": same})
            if not same:
                differ.append(t)
    gpu_evidence.append({"test": f"attention_tiles_{hq}q{hkv}kv", "candidates": outcomes,
                         "decode_positions": pos.tolist(), "chunked_after": pre})
    assert not differ, f"{len(differ)} of {len(outcomes)} candidate tiles differ from the fixed tile: {differ}"


def _mixed_prefill(hq, hkv, seed, d=128, pool=20_000, width=8192):
    """A batch of fresh prompts and chunks after cached prefixes of mixed lengths (1 to 4,200 keys, across
    blocks and segments) over a paged pool read through req_to_token rows: (run, q, kb, vb, table, rows,
    pre, new), ``run(tile)`` the prefill form over it."""
    g = _gen(seed)
    kb, vb = _randn(g, pool, hkv, d), _randn(g, pool, hkv, d)
    pre = torch.tensor([0, 0, 1, 63, 128, 300, 1000, 0, 4000], device="cuda", dtype=torch.int32)
    new = torch.tensor([1, 200, 64, 65, 129, 700, 24, 4200, 200], device="cuda", dtype=torch.int32)
    starts = torch.cumsum(new, 0, dtype=torch.int32) - new
    tq, n = int(new.sum()), len(new)
    q = _randn(g, tq, hq, d)
    table = torch.randint(0, pool, (n + 3, width), device="cuda", generator=g, dtype=torch.int32)
    rows = torch.randperm(n + 3, device="cuda", generator=g)[:n]  # int64, as SGLang's req_pool_indices
    mq = int(new.max())

    def run(tile=None):
        return attention(q, kb, vb, table, starts, new, pre, mq, kv_rows=rows, max_kv_len=width, tile=tile)
    return run, q, kb, vb, table, rows, pre, new


@pytest.mark.parametrize("hq,hkv", TILE_HEADS)
def test_attention_prefill_flat_loop_keeps_the_bits(hq, hkv, gpu_evidence):
    """The prefill form in the flat loop (``set_prefill_loop("flat")``, as TRUE_ON_POLICY_PREFILL_LOOP=flat
    installs it, and each candidate tile with loop="flat") == the nested loop, bitwise: a batch of fresh
    prompts and chunks after cached prefixes of mixed lengths (1 to 4,200 keys, across blocks and segments)
    read through req_to_token rows of a paged pool, and one long prefill the split rule splits."""
    import true_on_policy.kernels.attention as A

    width = 8192
    run, q, kb, vb, table, rows, pre, new = _mixed_prefill(hq, hkv, hq * 11 + hkv, width=width)
    nested = run()
    checked = []
    try:
        A.set_prefill_loop("flat")
        _same(run(), nested, f"{hq}/{hkv} prefill, set_prefill_loop('flat')")
    finally:
        A.set_prefill_loop("nested")
    for tile in A.candidate_tiles(hq // hkv):
        if tile.get("loop") == "flat":
            base = {k: v for k, v in tile.items() if k != "loop"}
            _same(run(tile), run(base), f"{hq}/{hkv} prefill {A.tile_label(tile)}")
            checked.append(A.tile_label(tile))
    one_q = q[:4200].clone()  # one long prompt alone: few programs, so the split rule splits its segments
    lone = [torch.tensor([a], device="cuda", dtype=torch.int32) for a in (0, 4200, 0)]
    long_nested = attention(one_q, kb, vb, table, *lone, 4200, kv_rows=rows[7:8], max_kv_len=width)
    long_flat = attention(one_q, kb, vb, table, *lone, 4200, kv_rows=rows[7:8], max_kv_len=width, tile={"loop": "flat"})
    _same(long_flat, long_nested, f"{hq}/{hkv} one 4,200-token prefill, flat")
    gpu_evidence.append({"test": f"attention_prefill_flat_{hq}q{hkv}kv", "prefix_lens": pre.tolist(),
                         "new_lens": new.tolist(), "flat_tiles": checked, "bitwise": True})


@pytest.mark.parametrize("hq,hkv", [(32, 4), (24, 6), (40, 2), (96, 8)])
def test_attention_prefill_choice_keeps_the_bits(hq, hkv, gpu_evidence):
    """``choose_prefill_tile`` as the first CUDA-graph capture runs it (a paged pool, the server's 40,960-token
    width): the prefill form without a tile then launches what it installed, and that, like every candidate
    of ``prefill_candidates``, gives the default's bits over fresh prompts and chunks after cached prefixes
    of mixed lengths read through req_to_token rows. Records the choice, its timings and its seconds."""
    import time

    import true_on_policy.kernels.attention as A

    d = 128
    run, _, kb, vb, _, _, _, _ = _mixed_prefill(hq, hkv, hq * 13 + hkv, d)
    A.clear_prefill_tiles()
    default = run()
    times: dict = {}
    try:
        t0 = time.perf_counter()
        tile = A.choose_prefill_tile(hq, hkv, d, kb, vb, 40960, times_out=times)
        seconds = time.perf_counter() - t0
        assert A.prefill_tile_for(hq, hkv, d) == (tile or {})
        _same(run(), default, f"{hq}/{hkv} prefill, the chosen tile {A.tile_label(tile)}")
        for cand in A.prefill_candidates():
            _same(run(cand), default, f"{hq}/{hkv} prefill {A.tile_label(cand)}")
    finally:
        A.clear_prefill_tiles()
    gpu_evidence.append({"test": f"attention_prefill_choice_{hq}q{hkv}kv", "chosen": A.tile_label(tile) if tile
                         else "default", "times_ms": times, "choice_s": round(seconds, 2), "bitwise": True})


@pytest.mark.parametrize("hq,hkv", [(32, 4), (24, 6), (40, 2), (96, 8)])
def test_attention_tiles_chosen_at_start_up_keep_the_bits(hq, hkv, gpu_evidence):
    """``choose_decode_tiles`` as the decode capture runs it (powers of two up to 256 over a paged
    K/V pool, the server's 40,960-token bound): whatever it picks, a decode batch with the choice
    installed == the fixed tile, at the timed batches and between them, sequences of mixed lengths;
    and so does every variant the choice times (``decode_variants``: tiles and splits) at 1, 16 and 64
    sequences. Records the choice and every variant's median time per batch."""
    import true_on_policy.kernels.attention as A

    g, d, pool = _gen(hq + hkv), 128, 300_000
    kb, vb = _randn(g, pool, hkv, d), _randn(g, pool, hkv, d)
    timed = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    try:
        times = {}
        choice = A.choose_decode_tiles(hq, hkv, d, timed, kb, vb, 40960, times_out=times)
        for b in (1, 3, 16, 50, 64, 200, 256):
            lens = torch.randint(1, 2000, (b,), device="cuda", generator=g, dtype=torch.int32)
            table = torch.randint(0, pool, (b, 40960), device="cuda", generator=g, dtype=torch.int32)
            q = _randn(g, b, hq, d)
            chosen = attention(q, kb, vb, table, None, None, None, 1, max_kv_len=40960, seq_lens=lens)
            fixed = attention(q, kb, vb, table, None, None, None, 1, max_kv_len=40960, seq_lens=lens,
                              tile=A.candidate_tiles(hq // hkv)[0])
            _same(chosen, fixed, f"{hq}/{hkv} batch {b} chosen {A.decode_tile_for(hq, hkv, d, b)}")
            if b in (1, 16, 64):
                for v in A.decode_variants(hq, hkv, b, 40960, A._fill(q), d)[1:]:
                    _same(attention(q, kb, vb, table, None, None, None, 1, max_kv_len=40960, seq_lens=lens, tile=v),
                          fixed, f"{hq}/{hkv} batch {b} variant {A.tile_label(v)}")
    finally:
        A.clear_decode_tiles()
    gpu_evidence.append({"test": f"attention_tiles_chosen_{hq}q{hkv}kv", "candidates": A.candidate_tiles(hq // hkv),
                         "choice": {str(b): t for b, t in choice.items()},
                         "ms_per_10_calls": {str(b): t for b, t in times.items()}, "bitwise": True})


def test_rope(gpu_evidence):
    g = _gen(5)
    x = _randn(g, 4097, 32, 128)
    c, s = cos_sin(torch.arange(4097, device="cuda") * 7, 128, 1e6)
    out = apply_rope(x, c, s)
    rel = _rel(out, apply_rope_reference(x.double(), c.double(), s.double()))
    assert rel < REL_TOL[torch.bfloat16], rel
    for n in COUNTS:
        cn, sn = cos_sin(torch.arange(n, device="cuda") * 7, 128, 1e6)
        _same(cn, c[:n], f"cos rows={n}")
        _same(apply_rope(x[:n].clone(), cn, sn), out[:n], f"rope rows={n}")
    gpu_evidence.append({"test": "rope_32h_d128", "rel_err_vs_f64": rel, "batch_invariant_counts": COUNTS})


@pytest.mark.parametrize("hq,hkv", [(32, 4), (24, 6), (40, 2), (64, 4)])
def test_rope_qk_and_kv_write_are_apply_ropes_bits(gpu_evidence, hq, hkv):
    """q and k rotated in one launch (the rollout's RoPE) are bitwise ``apply_rope`` of each (the
    trainer's), from the strided q/k/v views of one qkv row; the fused K/V write stores exactly the
    rotated k and the value rows at the given cache rows and nothing else."""
    d, g = 128, _gen(hq + hkv)
    for n in COUNTS:
        qkv = _randn(g, n, (hq + 2 * hkv) * d)
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
        c, s = cos_sin(torch.arange(n, device="cuda") * 7 + 3, d, 1e6)
        kc, vc = _randn(g, 2 * n + 5, hkv * d), _randn(g, 2 * n + 5, hkv * d)
        kc0, vc0 = kc.clone(), vc.clone()
        loc = torch.randperm(2 * n + 5, device="cuda", generator=g)[:n]
        qo, ko = apply_rope_qk(q, k, c, s, d, (v, kc, vc, loc))
        _same(qo.view(n, hq, d), apply_rope(q.reshape(n, hq, d), c, s), f"q {hq}/{hkv} rows={n}")
        _same(ko.view(n, hkv, d), apply_rope(k.reshape(n, hkv, d), c, s), f"k {hq}/{hkv} rows={n}")
        _same(kc[loc], ko, f"k cache {hq}/{hkv} rows={n}")
        _same(vc[loc], v, f"v cache {hq}/{hkv} rows={n}")
        rest = torch.ones(2 * n + 5, dtype=torch.bool, device="cuda")
        rest[loc] = False
        _same(kc[rest], kc0[rest], "k cache elsewhere")
        _same(vc[rest], vc0[rest], "v cache elsewhere")
        for a, b in zip(apply_rope_qk(q, k, c, s, d), (qo, ko), strict=True):
            _same(a, b, f"without the K/V write {hq}/{hkv} rows={n}")
    gpu_evidence.append({"test": f"rope_qk_kv_write_{hq}q{hkv}kv_d{d}", "bitwise_apply_rope": True, "counts": COUNTS})


@pytest.mark.parametrize("hq,hkv,d", [(32, 4, 128), (24, 6, 128), (40, 2, 128), (64, 4, 128), (16, 2, 64)])
def test_qk_norm_in_the_rope_launch_is_rmsnorm_then_ropes_bits(gpu_evidence, hq, hkv, d):
    """QK-norm, RoPE and the K/V write in one launch (TRUE_ON_POLICY_QK_NORM_ROPE=fused) give the
    separate path's bits: ``rmsnorm_heads`` of q and k, then ``apply_rope_qk`` with the K/V write;
    and the trainer's (``rmsnorm`` on the copied head rows, then ``apply_rope``). From the strided
    views of one qkv row, at every token count, with a large-magnitude row in each call."""
    from true_on_policy.kernels.rmsnorm import rmsnorm_heads

    g = _gen(hq * hkv + d)
    qw, kw = (1 + 0.1 * torch.randn(d, device="cuda", generator=g)).bfloat16(), _randn(g, d)
    for n in COUNTS:
        qkv = _randn(g, n, (hq + 2 * hkv) * d, scale=3.0)
        qkv[n // 2] *= 40  # a row whose squares reach far above the others
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
        c, s = cos_sin(torch.arange(n, device="cuda") * 7 + 3, d, 1e6)
        kc, vc = _randn(g, 2 * n + 5, hkv * d), _randn(g, 2 * n + 5, hkv * d)
        kc1, vc1 = kc.clone(), vc.clone()
        loc = torch.randperm(2 * n + 5, device="cuda", generator=g)[:n]
        qo, ko = apply_rope_qk(q, k, c, s, d, (v, kc, vc, loc), (qw, kw, 1e-6, 1e-5))
        qn, kn = rmsnorm_heads(q, qw, 1e-6).view(n, -1), rmsnorm_heads(k, kw, 1e-5).view(n, -1)
        qs, ks = apply_rope_qk(qn, kn, c, s, d, (v, kc1, vc1, loc))
        what = f"{hq}/{hkv}x{d} rows={n}"
        _same(qo, qs, f"q {what}")
        _same(ko, ks, f"k {what}")
        _same(kc, kc1, f"k cache {what}")
        _same(vc, vc1, f"v cache {what}")
        trainer_q = apply_rope(rmsnorm(q.reshape(-1, d).contiguous(), qw, 1e-6).view(n, hq, d), c, s)
        trainer_k = apply_rope(rmsnorm(k.reshape(-1, d).contiguous(), kw, 1e-5).view(n, hkv, d), c, s)
        _same(qo.view(n, hq, d), trainer_q, f"q vs the trainer's {what}")
        _same(ko.view(n, hkv, d), trainer_k, f"k vs the trainer's {what}")
        for a, b in zip(apply_rope_qk(q, k, c, s, d, None, (qw, kw, 1e-6, 1e-5)), (qo, ko), strict=True):
            _same(a, b, f"without the K/V write {what}")
    gpu_evidence.append({"test": f"qk_norm_rope_{hq}q{hkv}kv_d{d}", "bitwise_rmsnorm_then_rope": True,
                         "counts": COUNTS})


@pytest.mark.parametrize("rows,n_out,k,segments", [(1, 2048, 768, 8), (64, 2048, 768, 8), (257, 2048, 768, 8),
                                                   (4097, 2048, 768, 8), (64, 2048, 384, 4), (64, 2048, 96, 1),
                                                   (33, 2048, 4096, 8), (300, 136, 1536, 8)])
def test_tree_flat_equals_segmented(rows, n_out, k, segments, monkeypatch, gpu_evidence):
    """ROW_FLAT (one pipelined K loop in 32-wide chunks, segments folded at their boundaries)
    computes the same bits as ROW (a K loop per segment in 64-wide chunks, the last one masked):
    the same 16-wide MMA steps in the same order, plus exact zero products. Plain and expert-grouped."""
    import true_on_policy.kernels.matmul as mm
    from true_on_policy.kernels.moe import align

    g = _gen(rows + k)
    x, w = _randn(g, rows, k), _randn(g, n_out, k, scale=0.02)
    we = _randn(g, 4, n_out, k, scale=0.02)
    ids = torch.randint(0, 4, (rows, 2), device="cuda", generator=g, dtype=torch.int32)
    table, be, _, _ = align(ids, 0, 4)
    real = (be >= 0).repeat_interleave(mm.ALIGN) & (table >= 0)  # rows of unused blocks are undefined
    outs = {}
    monkeypatch.setattr(mm, "GROUPED_SEG", False)  # the grouped form under test is ROW_FLAT / ROW
    for flat in (True, False):
        monkeypatch.setattr(mm, "FLAT_TREE", flat)
        assert (mm._tiles(segments, True, k) is mm.ROW_FLAT) == flat
        grouped = mm.grouped_matmul(x, we, table, be, torch.float32, segments, tree=True)
        outs[flat] = (matmul(x, w, torch.float32, segments, tree=True), grouped[real])
    _same(outs[True][0], outs[False][0], f"plain rows={rows} K={k} segments={segments}")
    _same(outs[True][1], outs[False][1], f"grouped rows={rows} K={k} segments={segments}")
    gpu_evidence.append({"test": f"tree_flat_eq_row_r{rows}_n{n_out}_k{k}_s{segments}", "bitwise": True})


@pytest.mark.parametrize("tiles", ["configured", "flat16", "plain16k128", "flat64"])
def test_grouped_up_tiles_equal_column(tiles, monkeypatch, gpu_evidence):
    """The gate/up grouped GEMM computes COLUMN's bits with the configured GROUPED_UP tiles and with
    other candidates of benchmarks/tree_sweep.py (16-, 64-row tiles, BLOCK_K 64 or 128, flat loop),
    at decode and prefill token counts: only the speed depends on the tiles."""
    import true_on_policy.kernels.grouped_tma as gt
    import true_on_policy.kernels.matmul as mm
    from true_on_policy.kernels.moe import align

    monkeypatch.setattr(gt, "usable", lambda x, w: False)  # the pointer kernel's tiles (TMA: its own test)
    cfg = {"configured": mm.GROUPED_UP,
           "flat16": dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=5, N_GROUP=4, FLAT=True),
           "plain16k128": dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4),
           "flat64": dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4, N_GROUP=2, FLAT=True)}[tiles]
    g = _gen(11)
    w13 = _randn(g, 128, 1536, 2048, scale=0.03)
    for t in (1, 64, 256, 4096):
        x = _randn(g, t, 2048)
        ids = torch.rand(t, 128, device="cuda", generator=g).argsort(dim=1)[:, :8].int()
        rows, be, _, _ = align(ids, 0, 128)
        real = (be >= 0).repeat_interleave(mm.ALIGN) & (rows >= 0)
        monkeypatch.setattr(mm, "GROUPED_UP", mm.COLUMN)
        ref = mm.grouped_matmul(x, w13, rows, be)[real]
        monkeypatch.setattr(mm, "GROUPED_UP", cfg)
        _same(mm.grouped_matmul(x, w13, rows, be)[real], ref, f"gate/up {tiles} tokens={t}")
    gpu_evidence.append({"test": f"grouped_up_{tiles}_eq_column", "tiles": {k: v for k, v in cfg.items()},
                         "tokens": [1, 64, 256, 4096], "bitwise": True})


@pytest.mark.parametrize("experts,top_k", [(8, 2), (128, 8), (256, 6)])
def test_align_is_the_stable_argsort_table_in_both_forms(experts, top_k, gpu_evidence):
    """``align``'s one launch (the align kernel counts the slots: up to NBLOCK of them, a decode
    step) and its two launches (the count kernel first, above) both give the stable-argsort table of
    ``align_reference``: the rows of used blocks, the block experts, the slot positions and the down
    GEMM's own rows, in one process and in EP slices, from no token to past NBLOCK slots."""
    from helpers import assert_align_table
    from true_on_policy.kernels.moe import NBLOCK

    g = _gen(experts + top_k)
    tokens = [0, 1, 3, 64, NBLOCK // top_k, NBLOCK // top_k + 1, 4097]
    for t in tokens:
        ids = torch.rand(t, experts, device="cuda", generator=g).argsort(dim=1)[:, :top_k].int()
        if t > 3:
            ids[: t // 2, 0] = 1  # one expert holding more than ALIGN slots
        for first, local in ((0, experts), (experts // 2, experts - experts // 2), (experts // 4, experts // 4)):
            assert_align_table(ids, first, local)
    gpu_evidence.append({"test": f"align_e{experts}_k{top_k}_eq_argsort_table", "tokens": tokens,
                         "one_launch_up_to_slots": NBLOCK, "ep_slices": 3, "bitwise": True})


@pytest.mark.parametrize("hidden,experts,top_k,inter", [(256, 8, 2, 128), (2048, 128, 8, 768)])
def test_moe(hidden, experts, top_k, inter, gpu_evidence, monkeypatch):
    from true_on_policy.kernels import moe as M

    g = _gen(experts)
    x = _randn(g, 4097, hidden)
    rw, w13, w2 = _randn(g, experts, hidden, scale=0.05), _randn(g, experts, 2 * inter, hidden, scale=0.03), \
        _randn(g, experts, hidden, inter, scale=0.03)
    y = moe(x, rw, w13, w2, top_k)
    ref = moe_reference(x, rw, w13, w2, top_k)
    rel = _rel(y, ref.double())
    assert rel < REL_TOL[torch.bfloat16], rel
    for n in COUNTS:
        _same(moe(x[:n].clone(), rw, w13, w2, top_k), y[:n], f"tokens={n}")
    monkeypatch.setattr(M, "MOE_DOWN_BYTES", M.down_bytes(x.shape[0] // 3, top_k, hidden, experts))
    chunk = M.token_chunk(x.shape[0], top_k, hidden, experts, M.down_cap(x))
    assert chunk < x.shape[0]
    _same(moe(x, rw, w13, w2, top_k), y, f"token chunks of {chunk}")
    monkeypatch.setattr(M, "MOE_DOWN_BYTES", None)
    w, ids = route(matmul(x, rw), top_k)
    slots = torch.arange(x.shape[0] * top_k, device="cuda").view(-1, top_k)
    for t in (2, 4, 8):
        parts = []
        for r in range(t):
            parts.append(expert_outputs(x, ids, *tp_shard(w13, w2, r, t), 0, 8 // t))
        _same(combine(tree_sum(parts), slots, w, x.dtype), y, f"MoE TP={t}")
    for ep in (2, 4):
        n = experts // ep
        e = sum(expert_outputs(x, ids, w13[r * n:(r + 1) * n].contiguous(), w2[r * n:(r + 1) * n].contiguous(),
                               r * n, 8) for r in range(ep))
        _same(combine(e, slots, w, x.dtype), y, f"MoE EP={ep}")
    gpu_evidence.append({"test": f"moe_h{hidden}_e{experts}_k{top_k}_i{inter}", "rel_err_vs_torch_reference": rel,
                         "batch_invariant_counts": COUNTS, "token_chunk": chunk, "tp_simulated": [2, 4, 8],
                         "ep_simulated": [2, 4]})


def test_token_logprobs(gpu_evidence):
    g = _gen(7)
    logits = _randn(g, 4097, 151936, scale=3)
    tok = torch.randint(0, 151936, (4097,), device="cuda", generator=g)
    lp = token_logprobs(logits, tok, 0.7)
    ref = torch.log_softmax(logits.double() / 0.7, -1).gather(-1, tok[:, None])[:, 0]
    err = (lp.double() - ref).abs().max().item()
    assert err < 2e-5, err
    torch.testing.assert_close(lp, token_logprobs_reference(logits, tok, 0.7), rtol=1e-5, atol=2e-5)
    for n in COUNTS:
        _same(token_logprobs(logits[:n].clone(), tok[:n].clone(), 0.7), lp[:n], f"rows={n}")
    for t in (2, 4, 8):
        v = logits.shape[1] // t
        st = torch.cat([shard_stats(logits[:, r * v:(r + 1) * v].contiguous(), 0.7, SHARDS // t) for r in range(t)], 1)
        _same(finish(st, token_z(logits, tok, temperatures(0.7, len(tok), 'cuda'))), lp, f"vocab TP={t}")
    gpu_evidence.append({"test": "token_logprobs_vocab151936", "max_abs_vs_f64": err, "batch_invariant_counts": COUNTS,
                         "vocab_tp_simulated": [2, 4, 8]})


def _tree_inputs(rows, n_out, k, segments):
    """The tree GEMM tests' operands: x [rows, k], w [n_out, k], four experts' we, ``align``'s table of rows routed
    two apiece among them, its block experts and the mask of its real rows."""
    import true_on_policy.kernels.matmul as mm
    from true_on_policy.kernels.moe import align

    g = _gen(rows + k + segments)
    x, w = _randn(g, rows, k), _randn(g, n_out, k, scale=0.02)
    we = _randn(g, 4, n_out, k, scale=0.02)
    ids = torch.randint(0, 4, (rows, 2), device="cuda", generator=g, dtype=torch.int32)
    table, be, _, _ = align(ids, 0, 4)
    real = (be >= 0).repeat_interleave(mm.ALIGN) & (table >= 0)
    return x, w, we, table, be, real


def _flat_trees(x, w, we, table, be, segments):
    """ROW_FLAT's plain and expert-grouped trees of ``_tree_inputs``: the bits every tree form must give."""
    import true_on_policy.kernels.matmul as mm

    rows, n_out = x.shape[0], w.shape[0]
    flat = mm._launch(x, w, torch.empty(rows, n_out, dtype=torch.float32, device="cuda"), None, None, rows,
                      segments, mm.ROW_FLAT)
    gflat = mm._launch(x, we, torch.empty(table.shape[0], n_out, dtype=torch.float32, device="cuda"), table,
                       be.repeat_interleave(mm.ALIGN // mm.ROW_FLAT["BLOCK_M"]), table.shape[0], segments, mm.ROW_FLAT)
    return flat, gflat


SEG_TILES = {"configured": None,  # matmul.ROW_SEG, what the MoE down projection runs
             "decode16": dict(BLOCK_M=16, BLOCK_N=64, BK=64, num_warps=4, num_stages=3),
             "k32": dict(BLOCK_M=16, BLOCK_N=64, BK=32, num_warps=4, num_stages=3),
             "m32n64": dict(BLOCK_M=32, BLOCK_N=64, BK=64, num_warps=4, num_stages=3),
             "wgmma64": dict(BLOCK_M=64, BLOCK_N=64, BK=64, num_warps=4, num_stages=3),
             "wgmma128": dict(BLOCK_M=128, BLOCK_N=64, BK=64, num_warps=8, num_stages=3),
             "m128n32": dict(BLOCK_M=128, BLOCK_N=32, BK=64, num_warps=8, num_stages=3)}
# (the last four with "configured": matmul.TREE_CANDIDATES, the tiles the start-up choice times)


@pytest.mark.parametrize("tiles", sorted(SEG_TILES))
@pytest.mark.parametrize("rows,n_out,k,segments", [(1, 2048, 768, 8), (257, 2048, 768, 8), (4097, 2048, 768, 8),
                                                   (64, 2048, 384, 4), (33, 2048, 4096, 8), (300, 136, 1536, 8),
                                                   (65, 512, 192, 2), (65, 512, 96, 1), (300, 512, 2560, 8)])
def test_seg_tree_equals_flat(tiles, rows, n_out, k, segments, gpu_evidence):
    """``seg_tree`` (segments as the pipelined loop, a segment in BK chunks plus a tail, the tree
    folded by selects) computes ROW_FLAT's bits, plain and expert-grouped, for every tile set; a start-up choice
    candidate at the stages that fit where the segment is too wide for its own (Coder-480B-A35B's 320 columns)."""
    import true_on_policy.kernels.matmul as mm
    import true_on_policy.kernels.seg_tree as st

    cfg = SEG_TILES[tiles] or mm.ROW_SEG
    if not st.fits(k // segments, cfg["BK"]):
        pytest.skip(f"segment {k // segments} does not split into {cfg['BK']}-wide chunks")
    if not st.smem_ok(k // segments, cfg):
        cfg = mm.staged(k // segments, cfg)
        if cfg not in mm.tree_candidates(k // segments):
            pytest.skip("staged operands exceed shared memory: grouped_matmul runs ROW_FLAT for such segments")
    x, w, we, table, be, real = _tree_inputs(rows, n_out, k, segments)
    flat, gflat = _flat_trees(x, w, we, table, be, segments)
    seg = st.launch(x, w, torch.empty(rows, n_out, dtype=torch.float32, device="cuda"), None, None, rows, segments,
                    cfg)
    _same(seg, flat, f"plain {tiles} rows={rows} K={k} S={segments}")
    per = mm.ALIGN // cfg["BLOCK_M"]
    bexp = be[:, None].expand(-1, per).reshape(-1).contiguous()
    gseg_api = mm.grouped_matmul(x, we, table, be, torch.float32, segments, tree=True)  # what the MoE calls
    _same(gseg_api[real], gflat[real], f"grouped_matmul rows={rows} K={k} S={segments}")
    gseg = st.launch(x, we, torch.empty_like(gflat), table, bexp, table.shape[0], segments, cfg)
    _same(gseg[real], gflat[real], f"grouped {tiles} rows={rows} K={k} S={segments}")
    gpu_evidence.append({"test": f"seg_tree_{tiles}_r{rows}_n{n_out}_k{k}_s{segments}", "bitwise": True})


SMEM_TILES = {"m128": None,  # seg_tree_smem.TILE
               "m128k64": dict(BLOCK_M=128, BLOCK_N=128, BK=64, num_warps=8, STAGES=3),
               "m64": dict(BLOCK_M=64, BLOCK_N=128, BK=32, num_warps=4, STAGES=6),
               "m128pingpong": dict(BLOCK_M=128, BLOCK_N=128, BK=32, num_warps=8, STAGES=5, PINGPONG=True),
               "m64pingpong": dict(BLOCK_M=64, BLOCK_N=128, BK=32, num_warps=4, STAGES=6, PINGPONG=True),
               "m128tma": dict(BLOCK_M=128, BLOCK_N=128, BK=32, num_warps=8, STAGES=5, TMA_B=True),
               "m128pingpongtma": dict(BLOCK_M=128, BLOCK_N=128, BK=32, num_warps=8, STAGES=5, PINGPONG=True,
                                       TMA_B=True)}


@pytest.mark.parametrize("tiles", sorted(SMEM_TILES))
@pytest.mark.parametrize("rows,n_out,k,segments", [(1, 2048, 768, 8), (257, 2048, 768, 8), (4097, 2048, 768, 8),
                                                   (64, 2048, 384, 4), (300, 136, 1536, 8), (65, 512, 192, 2),
                                                   (65, 512, 96, 1), (300, 512, 2560, 8), (2049, 4096, 1536, 8)])
def test_seg_tree_smem_equals_flat(tiles, rows, n_out, k, segments, gpu_evidence):
    """``seg_tree_smem`` (the tree's waiting partials in shared memory, Gluon) computes ROW_FLAT's bits, plain and
    expert-grouped through ``align``'s table, at every tile it offers, with one accumulator and with two (PINGPONG: a
    segment folds while the next multiplies), the weights by ``cp.async`` and by TMA (TMA_B), where its chunks split
    the segments."""
    import true_on_policy.kernels.matmul as mm
    import true_on_policy.kernels.seg_tree_smem as sm
    from true_on_policy.kernels.limits import KernelLimitError

    cfg = SMEM_TILES[tiles] or sm.TILE
    x, w, we, table, be, real = _tree_inputs(rows, n_out, k, segments)
    try:
        sm.check(x, we, torch.empty(1, 1, dtype=torch.float32, device="cuda"), segments, cfg)
    except KernelLimitError as e:
        pytest.skip(str(e))
    flat, gflat = _flat_trees(x, w, we, table, be, segments)
    got = sm.launch(x, w, torch.empty(rows, n_out, dtype=torch.float32, device="cuda"), None, None, rows, segments,
                    cfg)
    _same(got, flat, f"plain {tiles} rows={rows} K={k} S={segments}")
    bexp = be.repeat_interleave(mm.ALIGN // cfg["BLOCK_M"])
    gsm = sm.launch(x, we, torch.empty_like(gflat), table, bexp, table.shape[0], segments, cfg, group=mm.MOE_GROUP_M)
    _same(gsm[real], gflat[real], f"grouped {tiles} rows={rows} K={k} S={segments}")
    gpu_evidence.append({"test": f"seg_tree_smem_{tiles}_r{rows}_n{n_out}_k{k}_s{segments}", "bitwise": True})


GT_TILES = {"m16": dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4),
            "m64": dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4),
            "m128k64": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4),
            "m64k128": dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=3)}


@pytest.mark.parametrize("tiles", sorted(GT_TILES))
def test_grouped_tma_equals_column(tiles, gpu_evidence):
    """The gate/up grouped GEMM with weights fetched by TMA computes COLUMN's bits (the pointer
    kernel), at decode and prefill token counts, with an N that is not a multiple of the tile."""
    import true_on_policy.kernels.grouped_tma as gt
    import true_on_policy.kernels.matmul as mm
    from true_on_policy.kernels.moe import align

    cfg = GT_TILES[tiles]
    g = _gen(13)
    for n_out, k in ((1536, 2048), (200, 640)):
        w13 = _randn(g, 128, n_out, k, scale=0.03)
        for t in (1, 64, 256, 4096):
            x = _randn(g, t, k)
            ids = torch.rand(t, 128, device="cuda", generator=g).argsort(dim=1)[:, :8].int()
            rows, be, _, _ = align(ids, 0, 128)
            real = (be >= 0).repeat_interleave(mm.ALIGN) & (rows >= 0)
            ref = mm._launch(x, w13, torch.empty(rows.shape[0], n_out, dtype=torch.bfloat16, device="cuda"), rows,
                             be, rows.shape[0], 1, mm.COLUMN)
            per = mm.ALIGN // cfg["BLOCK_M"]
            bexp = be[:, None].expand(-1, per).reshape(-1).contiguous()
            assert gt.usable(x, w13)
            got = gt.launch(x, w13, torch.empty_like(ref), rows, bexp, rows.shape[0], cfg)
            _same(got[real], ref[real], f"grouped TMA {tiles} N={n_out} K={k} tokens={t}")
    gpu_evidence.append({"test": f"grouped_tma_{tiles}_eq_column", "tiles": cfg, "tokens": [1, 64, 256, 4096],
                         "bitwise": True})


_DOWN = table_tiles(DOWN_TOKENS) + table_tiles(DOWN_TMA)
DOWN_TILES = [c for i, c in enumerate(_DOWN) if c not in _DOWN[:i]]  # each tile once


@pytest.mark.parametrize("tiles", range(len(DOWN_TILES)))
def test_down_tma_tiles_equal_column(tiles, gpu_evidence):
    """Every tile of the flat down projection's tables (``matmul.DOWN_TOKENS``, by the token count, and
    ``matmul.DOWN_TMA``, by the rows per expert) computes the pointer kernel's fp32 bits at the 30B-A3B down
    shape (N 2048, K 768) and at an N that is not a multiple of the tile, at every token count (not only
    those of its own bound), and so does ``grouped_matmul(role="down")``, with the count alone and with its slots."""
    import true_on_policy.kernels.grouped_tma as gt
    import true_on_policy.kernels.matmul as mm
    from true_on_policy.kernels.moe import align

    cfg = DOWN_TILES[tiles]
    g = _gen(17)
    for n_out, k in ((2048, 768), (200, 640)):
        w2 = _randn(g, 128, n_out, k, scale=0.03)
        for t in (1, 64, 256, 257, 4096):
            ids = torch.rand(t, 128, device="cuda", generator=g).argsort(dim=1)[:, :8].int()
            _, be, _, own = align(ids, 0, 128)
            h = _randn(g, own.shape[0], k)
            real = (be >= 0).repeat_interleave(mm.ALIGN) & (own >= 0)
            ref = mm._launch(h, w2, torch.empty(own.shape[0], n_out, dtype=torch.float32, device="cuda"), own,
                             be, own.shape[0], 1, mm.COLUMN)
            per = mm.ALIGN // cfg["BLOCK_M"]
            bexp = be[:, None].expand(-1, per).reshape(-1).contiguous()
            got = gt.launch(h, w2, torch.empty_like(ref), own, bexp, own.shape[0], cfg)
            _same(got[real], ref[real], f"down TMA {cfg} N={n_out} K={k} tokens={t}")
            for slots in (None, t * 8):
                api = mm.grouped_matmul(h, w2, own, be, torch.float32, 1, tree=False, role="down", tokens=t, slots=slots)
                _same(api[real], ref[real], f"grouped_matmul(role=down) tokens={t} slots={slots}")
    gpu_evidence.append({"test": f"down_tma_tile{tiles}_eq_column", "tiles": cfg, "tokens": [1, 64, 256, 257, 4096],
                         "bitwise": True})


def test_row_linear_rounds_like_a_cast(gpu_evidence):
    """At one rank ``row_linear`` rounds the fp32 root inside the tree kernel; that is torch's
    fp32 -> bf16 cast of the same root, bit for bit (round to nearest even)."""
    g = _gen(23)
    for rows in (1, 256, 4097):
        x, w = _randn(g, rows, 4096), _randn(g, 2048, 4096, scale=0.02)
        _same(row_linear(x, w), row_linear(x, w, out_dtype=torch.float32).to(torch.bfloat16), f"rows={rows}")
    gpu_evidence.append({"test": "row_linear_bf16_eq_fp32_root_cast", "rows": [1, 256, 4097], "bitwise": True})


@pytest.mark.parametrize("heads,d", [(32, 128), (4, 128), (6, 64), (1, 128)])
def test_rmsnorm_heads_equals_rows(heads, d, gpu_evidence):
    """QK-norm on the strided head views of a fused qkv output == ``rmsnorm`` on the copied
    [T * heads, D] rows (what SGLang and the trainer run), bit for bit, at every token count."""
    from true_on_policy.kernels.rmsnorm import rmsnorm_heads

    g = _gen(heads * d)
    qkv = _randn(g, 4097, (heads + 8) * d)
    w = (1 + 0.1 * torch.randn(d, device="cuda", generator=g)).bfloat16()
    for n in COUNTS:
        q = qkv[:n, :heads * d]  # a strided view, as qkv.split gives
        _same(rmsnorm_heads(q, w, 1e-6), rmsnorm(q.reshape(-1, d), w, 1e-6), f"heads={heads} d={d} rows={n}")
        k = qkv[:n, (heads + 3) * d:(heads + 4) * d]  # a view at an offset, as the k heads are
        _same(rmsnorm_heads(k, w, 1e-6), rmsnorm(k.contiguous().view(-1, d), w, 1e-6), f"k view d={d} rows={n}")
    gpu_evidence.append({"test": f"rmsnorm_heads_{heads}x{d}_eq_rows", "counts": COUNTS, "bitwise": True})


def _width_forms_batch_invariant(width: int, seed: int, whole: str, gpu_evidence):
    """At tree width ``width`` (in a fresh process: the width is set once per process), at the 30B-A3B
    shapes: o_proj (``row_linear``) and the MoE block give every row the same bits in a batch of 1, 7,
    64, 256, 257, 1000 and 4096 rows (the tile tables switch tiles above 256 rows), and o_proj's whole
    batch is ``whole`` (an expression of x and wo: the form the width's bits are defined by)."""
    import subprocess
    import sys

    code = f"""
import torch
from true_on_policy.kernels.matmul import matmul, split_matmul
from true_on_policy.kernels.moe import moe
from true_on_policy.kernels.tree_reduce import row_linear, use_tree_width
use_tree_width({width})
g = torch.Generator(device="cuda").manual_seed({seed})
r = lambda *s, sc=1.0: (torch.randn(*s, device="cuda", generator=g) * sc).bfloat16()
x, wo = r(4096, 4096), r(2048, 4096, sc=0.02)
full = row_linear(x, wo)
assert torch.equal(full, {whole})
xm, router, w13, w2 = r(4096, 2048), r(128, 2048, sc=0.05), r(128, 1536, 2048, sc=0.02), r(128, 2048, 768, sc=0.02)
ym = moe(xm, router, w13, w2, 8)
for n in (1, 7, 64, 256, 257, 1000):  # both sides of the tile tables' bound (matmul.DECODE_ROWS)
    assert torch.equal(row_linear(x[-n:].clone(), wo), full[-n:]), ("o_proj", n)
    assert torch.equal(moe(xm[-n:].clone(), router, w13, w2, 8), ym[-n:]), ("moe", n)
print("width-ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "width-ok" in r.stdout, r.stderr[-3000:]
    gpu_evidence.append({"test": f"tree_width_{width}_batch_invariance", "rows": [1, 7, 64, 256, 257, 1000, 4096]})


def test_tree_width_1_forms_are_batch_invariant_at_the_real_shape(gpu_evidence):
    """The flat contract's forms (tree width 1) at the 30B-A3B shapes: o_proj as the plain GEMM and the
    MoE block with its down projection as one K loop are batch-invariant across the tile tables'
    bound, and o_proj's bits are the column GEMM's."""
    _width_forms_batch_invariant(1, 11, "matmul(x, wo)", gpu_evidence)


# Qwen3-MoE layer geometries (hidden, query heads, KV heads, head_dim, experts, top-k, moe_intermediate): 30B-A3B,
# 235B-A22B and an odd one; the row counts cross the decode tiles' BLOCK_M steps and DECODE_ROWS
DECODE_GEOMETRIES = {"30b_a3b": (2048, 32, 4, 128, 128, 8, 768), "235b_a22b": (4096, 64, 4, 128, 128, 8, 1536),
                     "h1536e256k6": (1536, 24, 6, 128, 256, 6, 512)}
# A test whose expert weights hold 2**29 elements or more (each drawn in fp32: 2 GiB and up) runs in one xdist group:
# under ``--dist loadgroup`` (regenerate_evidence.sh's XDIST) those tests run one after another in one worker, so
# no two of them share the card at once.
BIG_GPU_MEMORY = pytest.mark.xdist_group("big_gpu_memory")


def _big(hidden: int, experts: int, inter: int) -> bool:
    return hidden * experts * inter >= 2**29


def _geometries():
    """DECODE_GEOMETRIES' names as parameters, the big ones in the big-memory group."""
    return [pytest.param(n, marks=BIG_GPU_MEMORY) if _big(*(DECODE_GEOMETRIES[n][i] for i in (0, 4, 6))) else n
            for n in sorted(DECODE_GEOMETRIES)]


DECODE_COUNTS = [1, 2, 3, 7, 8, 16, 64, 255, 256, 257, 4096]


@pytest.mark.parametrize("geometry", _geometries())
def test_halves_equal_tree(geometry, gpu_evidence):
    """Tree width 2 (``qwen3_moe_true_on_policy_w2_preview_v1``) at a Qwen3-MoE layer's shapes: the
    two-segment TMA forms (o_proj: every "row" candidate tile through ``halves_tile``; the MoE down
    projection: DOWN2_TMA's tiles and the grouped decode grid's, one tile per program and the block
    loop) == the pointer kernels' 2-segment tree (``split_matmul`` planes; ``seg_tree`` / ROW_FLAT),
    bit for bit, at decode and prefill row counts; a TP-2 rank's plain loop over its half, the two
    roots added in rank order, == the whole; ``row_linear`` at width 2 rounds the root as a cast."""
    from true_on_policy.kernels import grouped_tma
    from true_on_policy.kernels import matmul as mm
    from true_on_policy.kernels.moe import align

    h, hq, _, d, e, top_k, inter = DECODE_GEOMETRIES[geometry]
    g = _gen(sum(DECODE_GEOMETRIES[geometry]))
    k = hq * d
    x, wo = _randn(g, 4096, k), _randn(g, h, k, scale=0.02)
    row_tiles = [c for c in (mm.halves_tile(c, k) for c in mm.candidate_tiles("row")) if c is not None]
    assert row_tiles, "no o_proj tile divides K / 2"
    for rows in (1, 7, 64, 257, 4096):
        xr = x[:rows].clone()
        want = mm.split_matmul(xr, wo, 2, torch.float32)
        for cfg in row_tiles:
            got = mm._launch_tma(xr, wo, torch.empty(rows, h, device="cuda"), cfg, segments=2)
            _same(got, want, f"o_proj halves {cfg} rows={rows}")
        half = k // 2
        roots = [mm.split_matmul(xr[:, r * half:(r + 1) * half].contiguous(), wo[:, r * half:(r + 1) * half].contiguous(),
                                 1, torch.float32) for r in range(2)]
        _same(roots[0] + roots[1], want, f"o_proj TP-2 roots rows={rows}")
        _same(row_linear(xr, wo, width=2), want.bfloat16(), f"row_linear(width=2) rows={rows}")
    # the down projection: expert-grouped rows of a routed batch
    w2 = _randn(g, e, h, inter, scale=0.02)
    down_tiles = [c for c in (mm.halves_tile(c, inter) for c in mm.table_tiles(mm.DOWN2_TMA)
                              + list(mm.DECODE_GRID.values())) if c is not None]
    for t in (1, 16, 256, 4096):
        ids = torch.stack([torch.randperm(e, device="cuda", generator=g)[:top_k] for _ in range(t)]).int()
        rows, be, _, own = align(ids, 0, e)
        hx = _randn(g, rows.shape[0], inter)
        used = (be >= 0).repeat_interleave(mm.ALIGN) & (own >= 0)
        want = mm.grouped_matmul(hx, w2, own, be, torch.float32, 2, tree=True)  # seg_tree or the pointer tree
        for cfg in down_tiles:
            for sub in (1, mm.ALIGN // cfg["BLOCK_M"]):
                b = be.repeat_interleave(mm.ALIGN // (cfg["BLOCK_M"] * sub))
                got = grouped_tma.launch(hx, w2, torch.empty_like(want), own, b, rows.shape[0], cfg, subtiles=sub,
                                         segments=2)
                _same(got[used], want[used], f"down halves {cfg} sub={sub} t={t}")
        half = inter // 2  # an expert-TP-2 rank's call (moe._expert_sorted at one segment): the plain grouped GEMM
        roots = [mm.grouped_matmul(hx[:, r * half:(r + 1) * half].contiguous(), w2[:, :, r * half:(r + 1) * half].contiguous(),
                                   own, be, torch.float32, 1, tree=False, tokens=t, slots=t * top_k) for r in range(2)]
        _same((roots[0] + roots[1])[used], want[used], f"down TP-2 roots t={t}")
        got = mm.grouped_matmul(hx, w2, own, be, torch.float32, 2, tree=True, role="tree2", tokens=t, slots=t * top_k)
        _same(got[used], want[used], f"down tree2 dispatch t={t}")  # the rollout's call at width 2
    gpu_evidence.append({"test": f"halves_eq_tree_{geometry}", "row_tiles": len(row_tiles), "down_tiles": len(down_tiles),
                         "o_proj_rows": [1, 7, 64, 257, 4096], "down_tokens": [1, 16, 256, 4096]})


def test_tree_width_2_forms_are_batch_invariant_at_the_real_shape(gpu_evidence):
    """The width-2 preview's forms at the 30B-A3B shapes: o_proj and the MoE block are batch-invariant
    across the decode tiles and the tables' bound, and o_proj's bits are the pointer kernels' 2-segment
    tree."""
    _width_forms_batch_invariant(2, 12, "split_matmul(x, wo, 2)", gpu_evidence)


def _down_rows(g, t, e, top_k, kd):
    """The MoE down projection's input as the rollout builds it: t tokens routed to top_k of e experts at
    random, ``moe.align``'s table (block experts, token of each row), a random bf16 row per table row and
    the mask of the real rows."""
    import true_on_policy.kernels.matmul as mm
    from true_on_policy.kernels.moe import align

    ids = torch.rand(t, e, device="cuda", generator=g).argsort(dim=1)[:, :top_k].int()
    _, be, _, own = align(ids, 0, e)
    return be, own, _randn(g, own.shape[0], kd), (be >= 0).repeat_interleave(mm.ALIGN) & (own >= 0)


@pytest.mark.parametrize("geometry", _geometries())
def test_seg_tree_tma_equals_pointer(geometry, monkeypatch, gpu_evidence):
    """``seg_tree`` with the weights by tensor descriptor (``tma``, TRUE_ON_POLICY_SEG_TMA=tma) computes the
    pointer form's bits for the geometry's down projection under v1 (8 segments) and at a TP-2 rank's 4: every
    candidate tile, one tile per program and the decode block loop, at decode and prefill token counts; and
    ``grouped_matmul`` with ``SEG_TMA`` on gives what it gives off."""
    import true_on_policy.kernels.matmul as mm
    import true_on_policy.kernels.seg_tree as st

    h, _, _, _, e, top_k, inter = DECODE_GEOMETRIES[geometry]
    g = _gen(h + inter + 3)
    checked = 0
    for segments in (8, 4):
        kd = inter * segments // 8
        w2 = _randn(g, e, h, kd, scale=0.03)
        for t in DECODE_COUNTS:
            be, own, hx, real = _down_rows(g, t, e, top_k, kd)
            p = own.shape[0]
            for cfg in mm.candidate_tiles("seg_tree"):  # ROW_SEG first
                seg = kd // segments  # (the start-up choice's candidates run past smem_ok's budget)
                if not (st.fits(seg, cfg["BK"]) and (st.smem_ok(seg, cfg) or cfg in mm.tree_candidates(seg))):
                    continue
                for sub in (1, mm.ALIGN // cfg["BLOCK_M"]):
                    count = p if sub == 1 else mm.used_blocks(t * top_k, e) * mm.ALIGN
                    bexp = be.repeat_interleave(mm.ALIGN // (cfg["BLOCK_M"] * sub))
                    outs = [st.launch(hx, w2, torch.empty(p, h, dtype=torch.float32, device="cuda"), own, bexp, count,
                                      segments, cfg, subtiles=sub, tma=tma) for tma in (False, True)]
                    _same(outs[1][real], outs[0][real], f"{geometry} S={segments} tokens={t} tile {cfg} sub={sub}")
                    checked += 1
            api = []
            for on in (False, True):
                monkeypatch.setattr(mm, "SEG_TMA", on)
                api.append(mm.grouped_matmul(hx, w2, own, be, torch.float32, segments, tree=True, tokens=t,
                                             slots=t * top_k))
            _same(api[1][real], api[0][real], f"{geometry} grouped_matmul S={segments} tokens={t} SEG_TMA on/off")
    assert checked
    gpu_evidence.append({"test": f"seg_tree_tma_eq_pointer_{geometry}", "tokens": DECODE_COUNTS, "segments": [8, 4],
                         "launches": checked, "bitwise": True})


@pytest.mark.parametrize("geometry", _geometries())
def test_decode_tiles_equal_pointer(geometry, monkeypatch, gpu_evidence):
    """Every tile the plain TMA GEMMs can take (``matmul.candidate_tiles``: ``decode_tile``'s grid and
    the fixed tiles) computes the pointer kernel's bits for qkv, o_proj (tree width 1), the router
    of the geometry and the lm_head (Qwen3's vocabulary, fp32 logits), at every row count (not only
    those it is chosen for); ``matmul`` with and without DECODE_TILES too, and the tile it picks is a
    candidate."""
    import true_on_policy.kernels.matmul as mm

    h, hq, hkv, d, e, _, _ = DECODE_GEOMETRIES[geometry]
    g = _gen(h + e)
    for role, n_out, k, dtype in (("plain", (hq + 2 * hkv) * d, h, torch.bfloat16), ("row", h, hq * d, torch.bfloat16),
                                  ("router", e, h, torch.bfloat16), ("lm_head", 151936, h, torch.float32)):
        x, w = _randn(g, max(DECODE_COUNTS), k), _randn(g, n_out, k, scale=0.02)
        cands = mm.candidate_tiles(role)
        for rows in DECODE_COUNTS:
            xr = x[:rows].clone()
            ref = mm._launch(xr, w, torch.empty(rows, n_out, dtype=dtype, device="cuda"), None, None, rows, 1, mm.COLUMN)
            for cfg in cands:
                got = mm._launch_tma(xr, w, torch.empty_like(ref), cfg)
                _same(got, ref, f"{geometry} {role} N={n_out} K={k} rows={rows} tile {cfg}")
            assert mm.tma_tiles(role, rows, n_out, k, mm.sm_count(x)) in cands
            for decode in (True, False):
                monkeypatch.setattr(mm, "DECODE_TILES", decode)
                _same(matmul(xr, w, dtype, role=role), ref, f"{geometry} matmul(role={role}) rows={rows} decode={decode}")
    gpu_evidence.append({"test": f"decode_tiles_eq_pointer_{geometry}", "rows": DECODE_COUNTS,
                         "tiles": len(mm.candidate_tiles("plain")), "bitwise": True})


@pytest.mark.parametrize("geometry", _geometries())
def test_grouped_decode_tiles_equal_pointer(geometry, monkeypatch, gpu_evidence):
    """Every tile the grouped TMA GEMMs can take (gate/up, bf16 out; the flat down projection, fp32
    out) computes the pointer kernel's bits at every token count, one tile per program over the
    whole table and as the decode path runs it (the block loop over ``used_blocks``' blocks);
    ``grouped_matmul`` with tokens and slots, with and without DECODE_TILES and with the tiles above the
    decode path by the rows per expert and by the token count (MOE_TOKEN_TILES), too."""
    import true_on_policy.kernels.grouped_tma as gt
    import true_on_policy.kernels.matmul as mm
    from true_on_policy.kernels.moe import align

    h, _, _, _, e, top_k, inter = DECODE_GEOMETRIES[geometry]
    g = _gen(h + e + top_k)
    for name, role, n_out, k, dtype in (("gate_up", "plain", 2 * inter, h, torch.bfloat16),
                                        ("down", "down", h, inter, torch.float32)):
        w = _randn(g, e, n_out, k, scale=0.03)
        for t in DECODE_COUNTS + [1024]:  # 1024: rows per expert between the bounds of DOWN_TMA
            ids = torch.rand(t, e, device="cuda", generator=g).argsort(dim=1)[:, :top_k].int()
            rows, be, _, own = align(ids, 0, e)
            table = rows if name == "gate_up" else own
            x = _randn(g, t if name == "gate_up" else table.shape[0], k)
            real = (be >= 0).repeat_interleave(mm.ALIGN) & (table >= 0)
            p = table.shape[0]
            ref = mm._launch(x, w, torch.empty(p, n_out, dtype=dtype, device="cuda"), table, be, p, 1, mm.COLUMN)[real]
            for cfg in mm.candidate_tiles(name):
                for sub in (1, mm.ALIGN // cfg["BLOCK_M"]):
                    count = p if sub == 1 else mm.used_blocks(t * top_k, e) * mm.ALIGN
                    bexp = be.repeat_interleave(mm.ALIGN // (cfg["BLOCK_M"] * sub))
                    got = gt.launch(x, w, torch.empty(p, n_out, dtype=dtype, device="cuda"), table, bexp, count, cfg,
                                    subtiles=sub)
                    _same(got[real], ref, f"{geometry} {name} tokens={t} tile {cfg} subtiles={sub}")
            for decode in (True, False):
                for by_tokens in (False, True):
                    monkeypatch.setattr(mm, "DECODE_TILES", decode)
                    monkeypatch.setattr(mm, "MOE_TOKEN_TILES", by_tokens)
                    api = mm.grouped_matmul(x, w, table, be, dtype, 1, tree=False, role=role, tokens=t,
                                            slots=t * top_k)
                    _same(api[real], ref, f"{geometry} grouped_matmul({name}) tokens={t} decode={decode} "
                          f"by_tokens={by_tokens}")
    gpu_evidence.append({"test": f"grouped_decode_tiles_eq_pointer_{geometry}", "tokens": DECODE_COUNTS + [1024],
                         "tiles": len(mm.candidate_tiles("gate_up")), "bitwise": True})


ORDER_GROUPS = [0, 1, 4, 8, 16]  # M blocks per group of programs (``matmul.program_tile``); 0: the column order


@pytest.mark.parametrize("geometry", _geometries())
def test_program_order_changes_no_bit(geometry, monkeypatch, gpu_evidence):
    """The MoE's grouped GEMMs above the decode path give the same bits in every order of their programs: the
    gate/up (bf16 out) and the flat down projection (fp32 out) by TMA at the rule's tile (``moe_tile``), and
    v1's 8-segment tree down projection (``seg_tree``, ROW_SEG and every candidate of the start-up choice),
    each launched in groups of 1, 4, 8 and 16 M blocks and in the column order, at 512 to 8192 tokens;
    ``grouped_matmul`` with MOE_COLUMN_ORDER off and on gives those bits too."""
    import true_on_policy.kernels.grouped_tma as gt
    import true_on_policy.kernels.matmul as mm
    import true_on_policy.kernels.seg_tree as st
    from true_on_policy.kernels.moe import align

    h, _, _, _, e, top_k, inter = DECODE_GEOMETRIES[geometry]
    g = _gen(h + e + top_k + 1)
    w13, w2 = _randn(g, e, 2 * inter, h, scale=0.03), _randn(g, e, h, inter, scale=0.03)
    for t in (512, 4096, 8192):
        ids = torch.rand(t, e, device="cuda", generator=g).argsort(dim=1)[:, :top_k].int()
        rows, be, _, own = align(ids, 0, e)
        x, hid = _randn(g, t, h), _randn(g, own.shape[0], inter)
        p, slots = own.shape[0], t * top_k
        assert not mm.grouped_decode(t, slots, e)
        for name, role, x_, w, table, dtype in (("gate_up", "plain", x, w13, rows, torch.bfloat16),
                                                ("down", "down", hid, w2, own, torch.float32)):
            real = (be >= 0).repeat_interleave(mm.ALIGN) & (table >= 0)
            cfg = mm.moe_tile(role, t, slots, e)
            bexp = be.repeat_interleave(mm.ALIGN // cfg["BLOCK_M"])
            outs = [gt.launch(x_, w, torch.empty(p, w.shape[1], dtype=dtype, device="cuda"), table, bexp, p, cfg,
                              group=grp)[real] for grp in ORDER_GROUPS]
            for grp, out in zip(ORDER_GROUPS[1:], outs[1:], strict=True):
                _same(out, outs[0], f"{geometry} {name} tokens={t} tile {cfg} group={grp}")
            for columns in (False, True):
                monkeypatch.setattr(mm, "MOE_COLUMN_ORDER", columns)
                api = mm.grouped_matmul(x_, w, table, be, dtype, 1, tree=False, role=role, tokens=t, slots=slots)
                _same(api[real], outs[0], f"{geometry} grouped_matmul({name}) tokens={t} columns={columns}")
        real = (be >= 0).repeat_interleave(mm.ALIGN) & (own >= 0)
        bexp = be.repeat_interleave(mm.ALIGN // mm.ROW_SEG["BLOCK_M"])
        outs = [st.launch(hid, w2, torch.empty(p, h, dtype=torch.float32, device="cuda"), own, bexp, p, 8, mm.ROW_SEG,
                          group=grp)[real] for grp in ORDER_GROUPS]
        for grp, out in zip(ORDER_GROUPS[1:], outs[1:], strict=True):
            _same(out, outs[0], f"{geometry} seg_tree tokens={t} group={grp}")
        for cfg in mm.tree_candidates(inter // 8)[1:]:  # the start-up choice's other candidates
            bexp = be.repeat_interleave(mm.ALIGN // cfg["BLOCK_M"])
            for grp in ORDER_GROUPS:
                out = st.launch(hid, w2, torch.empty(p, h, dtype=torch.float32, device="cuda"), own, bexp, p, 8, cfg,
                                group=grp)[real]
                _same(out, outs[0], f"{geometry} seg_tree tokens={t} tile {cfg} group={grp}")
        for columns in (False, True):
            monkeypatch.setattr(mm, "MOE_COLUMN_ORDER", columns)
            api = mm.grouped_matmul(hid, w2, own, be, torch.float32, 8, tree=True, tokens=t, slots=slots)
            _same(api[real], outs[0], f"{geometry} grouped_matmul(tree) tokens={t} columns={columns}")
    gpu_evidence.append({"test": f"program_order_no_bit_{geometry}", "tokens": [512, 4096, 8192],
                         "groups": ORDER_GROUPS, "bitwise": True})


def _timed_tree_choice(w2, cands):
    """``matmul.choose_tree_tiles`` at w2's shape in 8 segments, on the GPU: one of ``cands`` for every bucket, a
    positive time for every candidate; returns (chosen, times)."""
    import true_on_policy.kernels.matmul as mm

    times: dict = {}
    chosen = mm.choose_tree_tiles(w2, 8, times_out=times)
    assert set(chosen) == {str(rows) for _, rows in mm.TREE_BUCKETS} and all(c in cands for c in chosen.values())
    assert all(len(t) == len(cands) and min(t) > 0 for t in times.values()), times
    return chosen, times


@pytest.mark.parametrize("geometry", _geometries())
def test_the_tree_tile_choice_keeps_the_bits(geometry, monkeypatch, gpu_evidence):
    """The start-up choice of v1's tree down projection tile above the decode path (``matmul.choose_tree_tiles``)
    times every candidate at the geometry's shape and installs one of them per bucket of rows per expert; then
    ``grouped_matmul`` gives ROW_SEG's bits at 512 to 8192 tokens, under the choice and under TREE_FIXED, and
    takes the bucket's choice (ROW_SEG under TREE_FIXED)."""
    import true_on_policy.kernels.matmul as mm
    import true_on_policy.kernels.seg_tree as st

    h, _, _, _, e, top_k, inter = DECODE_GEOMETRIES[geometry]
    g = _gen(h + e + top_k + 2)
    w2 = _randn(g, e, h, inter, scale=0.03)
    seg, cands = inter // 8, mm.tree_candidates(inter // 8)
    monkeypatch.setattr(mm, "TREE_CHOSEN", {})
    chosen, times = _timed_tree_choice(w2, cands)
    for t in (512, 2048, 8192):
        be, own, hid, real = _down_rows(g, t, e, top_k, inter)
        p, slots = own.shape[0], t * top_k
        bexp = be.repeat_interleave(mm.ALIGN // mm.ROW_SEG["BLOCK_M"])
        ref = st.launch(hid, w2, torch.empty(p, h, dtype=torch.float32, device="cuda"), own, bexp, p, 8, mm.ROW_SEG)
        for fixed in (False, True):
            monkeypatch.setattr(mm, "TREE_FIXED", fixed)
            want = mm.ROW_SEG if fixed else mm.by_rows(mm.TREE_CHOSEN[seg, h, e], mm.expert_groups(slots, e)[1])
            assert mm.seg_prefill_tile(seg, h, slots, e) == want, (t, fixed)
            api = mm.grouped_matmul(hid, w2, own, be, torch.float32, 8, tree=True, tokens=t, slots=slots)
            _same(api[real], ref[real], f"{geometry} grouped_matmul(tree) tokens={t} fixed={fixed}")
    gpu_evidence.append({"test": f"tree_tile_choice_{geometry}", "bitwise": True, "times_ms": times,
                         "chosen": {r: "{BLOCK_M}x{BLOCK_N} w{num_warps} s{num_stages}".format(**c)
                                    for r, c in chosen.items()}})


@BIG_GPU_MEMORY
def test_the_wide_segment_choice_keeps_the_bits(monkeypatch, gpu_evidence):
    """Where v1's down projection's segments are too wide for ROW_SEG's stages (Coder-480B-A35B's 2560 / 8 = 320
    columns), the start-up choice times the flat loop that runs there against the candidates at the stages that
    fit, and installs one per bucket of rows per expert; then ``grouped_matmul`` gives the flat loop's bits at 512
    to 8192 tokens, under the choice and under TREE_FIXED, taking the bucket's ``seg_tree`` tile or the flat loop."""
    import true_on_policy.kernels.matmul as mm

    h, e, top_k, inter = 6144, 160, 8, 2560
    g = _gen(h + e + top_k + 3)
    w2 = _randn(g, e, h, inter, scale=0.03)
    flat, cands = mm._tiles(8, True, inter), mm.wide_candidates(inter, 8)
    assert cands and cands[0] == flat and not mm.seg_path(inter, 8)
    monkeypatch.setattr(mm, "TREE_CHOSEN", {})
    chosen, times = _timed_tree_choice(w2, cands)
    for t in (512, 2048, 8192):
        be, own, hid, real = _down_rows(g, t, e, top_k, inter)
        p, slots = own.shape[0], t * top_k
        ref = mm._launch(hid, w2, torch.empty(p, h, dtype=torch.float32, device="cuda"), own,
                         be.repeat_interleave(mm.ALIGN // flat["BLOCK_M"]), p, 8, flat)
        for fixed in (False, True):
            monkeypatch.setattr(mm, "TREE_FIXED", fixed)
            picked = None if fixed else mm.by_rows(mm.TREE_CHOSEN[inter // 8, h, e], mm.expert_groups(slots, e)[1])
            want = picked if picked is not None and mm.is_seg_tile(picked) else None
            assert mm.wide_prefill_tile(inter, 8, h, slots, e) == want, (t, fixed)
            api = mm.grouped_matmul(hid, w2, own, be, torch.float32, 8, tree=True, tokens=t, slots=slots)
            _same(api[real], ref[real], f"wide grouped_matmul(tree) tokens={t} fixed={fixed}")
    gpu_evidence.append({"test": "tree_tile_choice_wide_a35b", "bitwise": True, "times_ms": times,
                         "chosen": {r: ("{BLOCK_M}x{BLOCK_N} w{num_warps} s{num_stages}".format(**c)
                                        + ("" if mm.is_seg_tile(c) else " flat loop")) for r, c in chosen.items()}})


@pytest.mark.parametrize("geometry", _geometries())
def test_silu_in_up_equals_separate(geometry, monkeypatch, gpu_evidence):
    """The gate/up GEMM's GLU form (``grouped_matmul(glu=True)``: a gate tile and its up tile in one
    program, silu(gate) * up stored) computes ``moe.silu_mul`` of the same GEMM's gate/up rows: every
    gate/up tile, one tile per program and the decode block loop, at every decode token count; and
    ``moe.moe`` at both tree widths gives the same output with ``SILU_IN_UP`` on and off (on: the GLU
    form wherever ``glu_fusable``)."""
    import true_on_policy.kernels.grouped_tma as gt
    import true_on_policy.kernels.matmul as mm
    from true_on_policy.kernels import moe

    h, _, _, _, e, top_k, inter = DECODE_GEOMETRIES[geometry]
    g = _gen(h + inter)
    w13, w2 = _randn(g, e, 2 * inter, h, scale=0.03), _randn(g, e, h, inter, scale=0.03)
    router = _randn(g, e, h, scale=0.03)
    glu_counts = []
    for t in DECODE_COUNTS:
        x = _randn(g, t, h)
        ids = torch.rand(t, e, device="cuda", generator=g).argsort(dim=1)[:, :top_k].int()
        rows, be, pos, _ = moe.align(ids, 0, e)
        real = (be >= 0).repeat_interleave(mm.ALIGN) & (rows >= 0)
        p = rows.shape[0]
        for cfg in mm.candidate_tiles("gate_up"):
            for sub in (1, mm.ALIGN // cfg["BLOCK_M"]):
                count = p if sub == 1 else mm.used_blocks(t * top_k, e) * mm.ALIGN
                bexp = be.repeat_interleave(mm.ALIGN // (cfg["BLOCK_M"] * sub))
                gate_up = gt.launch(x, w13, torch.empty(p, 2 * inter, dtype=torch.bfloat16, device="cuda"), rows, bexp,
                                    count, cfg, subtiles=sub)
                want = moe.silu_mul(gate_up, pos)[real]
                got = gt.launch(x, w13, torch.empty(p, inter, dtype=torch.bfloat16, device="cuda"), rows, bexp, count,
                                cfg, subtiles=sub, glu=True)
                _same(got[real], want, f"{geometry} GLU tokens={t} tile {cfg} subtiles={sub}")
        for width in (1, 8):
            outs = []
            for on in (True, False):
                monkeypatch.setattr(moe, "SILU_IN_UP", on)
                outs.append(moe.moe(x, router, w13, w2, top_k, width=width))
            _same(outs[0], outs[1], f"{geometry} moe tokens={t} width={width} SILU_IN_UP on/off")
        if mm.glu_fusable(x, w13, t, t * top_k):
            glu_counts.append(t)
    assert glu_counts, f"{geometry}: no decode count took the GLU form"
    gpu_evidence.append({"test": f"silu_in_up_eq_separate_{geometry}", "tokens": DECODE_COUNTS,
                         "glu_tokens": glu_counts, "tiles": len(mm.candidate_tiles("gate_up")), "bitwise": True})


@pytest.mark.parametrize("segments", [8, 4, 2, 1])  # local segments at TP 1, 2, 4, 8 (K sharded alike)
@pytest.mark.parametrize("geometry", _geometries())
def test_tree_decode_tiles_equal_fixed(geometry, segments, monkeypatch, gpu_evidence):
    """Every tile the tree GEMMs can take (``matmul.candidate_tiles``: "split" with 1, 2 and 4 segments
    per plane, "tree", "seg_tree" over the whole table and as the decode path launches it, the block
    loop over ``used_blocks``' blocks) computes the fixed path's bits for o_proj and the MoE down
    projection of the geometry at every row count; the launchers with and without DECODE_TILES too."""
    import true_on_policy.kernels.matmul as mm
    import true_on_policy.kernels.seg_tree as st

    h, hq, _, d, e, top_k, inter = DECODE_GEOMETRIES[geometry]
    g = _gen(h + e + segments)
    k = hq * d * segments // 8
    x, w = _randn(g, max(DECODE_COUNTS), k), _randn(g, h, k, scale=0.02)
    for rows in DECODE_COUNTS:
        xr = x[:rows].clone()
        ref = mm.split_matmul(xr, w, segments, torch.float32, per_plane=1, cfg=mm.ROW)
        ref16 = mm.split_matmul(xr, w, segments, per_plane=1, cfg=mm.ROW)
        for cfg in mm.candidate_tiles("split"):
            for pp in (p for p in (1, 2, 4) if segments % p == 0):
                _same(mm.split_matmul(xr, w, segments, torch.float32, per_plane=pp, cfg=cfg), ref,
                      f"{geometry} split S={segments} rows={rows} per_plane={pp} tile {cfg}")
        for cfg in mm.candidate_tiles("tree"):
            if cfg.get("FLAT") and (k // segments) % cfg["BLOCK_K"]:
                continue
            got = mm._launch(xr, w, torch.empty_like(ref), None, None, rows, segments, cfg)
            _same(got, ref, f"{geometry} tree S={segments} rows={rows} tile {cfg}")
        for decode in (True, False):
            monkeypatch.setattr(mm, "DECODE_TILES", decode)
            _same(mm.split_matmul(xr, w, segments, torch.float32), ref, f"split_matmul rows={rows} decode={decode}")
            _same(mm.split_matmul(xr, w, segments), ref16, f"split_matmul bf16 rows={rows} decode={decode}")
            _same(matmul(xr, w, torch.float32, segments, tree=True), ref, f"matmul tree rows={rows} decode={decode}")
    kd = inter * segments // 8
    w2 = _randn(g, e, h, kd, scale=0.03)
    for t in DECODE_COUNTS:
        be, own, hx, real = _down_rows(g, t, e, top_k, kd)
        p = own.shape[0]
        ref = st.launch(hx, w2, torch.empty(p, h, dtype=torch.float32, device="cuda"), own,
                        be.repeat_interleave(mm.ALIGN // mm.ROW_SEG["BLOCK_M"]), p, segments, mm.ROW_SEG)[real]
        for cfg in mm.candidate_tiles("seg_tree"):
            if not st.smem_ok(kd // segments, cfg):
                continue
            for sub in (1, mm.ALIGN // cfg["BLOCK_M"]):
                count = p if sub == 1 else mm.used_blocks(t * top_k, e) * mm.ALIGN
                bexp = be.repeat_interleave(mm.ALIGN // (cfg["BLOCK_M"] * sub))
                got = st.launch(hx, w2, torch.empty(p, h, dtype=torch.float32, device="cuda"), own, bexp, count,
                                segments, cfg, subtiles=sub)
                _same(got[real], ref, f"{geometry} seg_tree S={segments} tokens={t} tile {cfg} subtiles={sub}")
        for decode in (True, False):
            monkeypatch.setattr(mm, "DECODE_TILES", decode)
            api = mm.grouped_matmul(hx, w2, own, be, torch.float32, segments, tree=True, tokens=t, slots=t * top_k)
            _same(api[real], ref, f"{geometry} grouped_matmul(tree) S={segments} tokens={t} decode={decode}")
            assert mm.seg_tiles(t, t * top_k, e, h, kd, segments, mm.sm_count(hx)) in mm.candidate_tiles("seg_tree")
    gpu_evidence.append({"test": f"tree_decode_tiles_eq_fixed_{geometry}_s{segments}", "rows": DECODE_COUNTS,
                         "tiles": {r: len(mm.candidate_tiles(r)) for r in mm.TREE_ROLES}, "bitwise": True})


@BIG_GPU_MEMORY
@pytest.mark.parametrize("segments", [8, 4])  # TP 1 and 2: 2560 / 8 and 1280 / 4, segments of 320 columns
def test_wide_decode_equals_flat(segments, gpu_evidence):
    """Coder-480B-A35B's MoE down projection, whose segments are too wide for ROW_SEG's stages: at decode token counts
    ``grouped_matmul`` runs ``seg_tree`` in a SEG_GRID tile over the used blocks (``matmul.wide_decode``), above them
    the flat loop (or a start-up choice's tile), and at every count the result is the flat loop's over the whole table,
    bit for bit."""
    import true_on_policy.kernels.matmul as mm

    h, e, top_k, inter = 6144, 160, 8, 2560
    kd = inter * segments // 8
    g = _gen(h + e + segments)
    w2 = _randn(g, e, h, kd, scale=0.03)
    wide = []
    for t in DECODE_COUNTS:
        be, own, hx, real = _down_rows(g, t, e, top_k, kd)
        p = own.shape[0]
        ref = mm._launch(hx, w2, torch.empty(p, h, dtype=torch.float32, device="cuda"), own,
                         be.repeat_interleave(mm.ALIGN // mm.ROW_FLAT["BLOCK_M"]), p, segments, mm.ROW_FLAT)[real]
        got = mm.grouped_matmul(hx, w2, own, be, torch.float32, segments, tree=True, tokens=t, slots=t * top_k)
        _same(got[real], ref, f"down S={segments} tokens={t}")
        if mm.wide_decode(t, t * top_k, e, kd, segments):
            wide.append(t)
    assert wide and wide[0] == 1, f"no decode count took seg_tree: {wide}"
    gpu_evidence.append({"test": f"wide_decode_eq_flat_s{segments}", "tokens": DECODE_COUNTS, "seg_tree_tokens": wide,
                         "bitwise": True})
