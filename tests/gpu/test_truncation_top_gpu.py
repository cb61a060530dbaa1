"""GPU tier: truncation by torch's top-k (``truncate(..., bound=b)``) and the sampler's cut form
(``sample`` with the bound: the draw forms logq from the row's cut) equal the sort bitwise at the
real vocabulary, in the sampler, the trainer and a CUDA graph.

Rows are the sampler's own log-probs of flat logits (many tokens near every cut), peaked ones and
tied ones (four values: every cut inside a tie wider than topk's width, where the scan kernel
places it), V = 151 936, batches of 1 .. 256 rows, top_k at most the bound with top_p / min_p mixed
in and untruncated and greedy rows among them, in SGLang's tensor forms. Asserted bitwise: the
whole fp32 logq; ``sample``'s ids and log-probs with the bound (the cut form, and top-k forming the
distribution when top log-probs are asked) == without (the sort), and that distribution; the
trainer's ``truncated_token_logprobs`` with a scalar top_k (its cut form) == the sampler's sort,
and with a tensor top_k (the sort) == the sampler's cut form; ``sample`` with the bound captured in
a CUDA graph and replayed == eager, with no host synchronisation. Speed: ``benchmarks/truncation.py``.
"""

import pytest
from test_truncation_select_gpu import V, _assert_ids, _assert_same, _captured, _draw_case, _logp, _sort

pytestmark = pytest.mark.gpu


def _bounded(rows, seed, bound):
    import torch

    g = torch.Generator().manual_seed(seed)
    k = torch.randint(1, bound + 1, (rows,), generator=g, dtype=torch.int32)
    p = torch.tensor([0.5, 0.9, 0.95, 1.0])[torch.randint(0, 4, (rows,), generator=g)]
    mp = torch.tensor([0.0, 0.0, 0.05, 0.3])[torch.randint(0, 4, (rows,), generator=g)]
    plain = torch.rand(rows, generator=g) < 0.2  # no top_k, top_p 1, min_p 0: untruncated
    k[plain], p[plain], mp[plain] = V, 1.0, 0.0
    return k.cuda(), p.float().cuda(), mp.float().cuda()


@pytest.mark.parametrize("bound", [1, 20, 1024])
@pytest.mark.parametrize("kind", ["flat", "peaked"])
@pytest.mark.parametrize("rows", [1, 2, 7, 64, 255, 256])
def test_top_k_equals_the_sort_bitwise(rows, kind, bound, gpu_evidence):
    from true_on_policy.kernels.sampling import select_truncation, truncate

    logp = _logp(kind, rows, rows * 13 + bound)
    params = _bounded(rows, rows + bound, bound)
    with select_truncation(False):
        top = truncate(logp, *params, bound=bound)
    _assert_same(top, _sort(logp, *params), f"{rows} rows, {kind}, bound {bound}")
    gpu_evidence.append({"test": "truncation_top_eq_sort", "rows": rows, "kind": kind, "bound": bound})


@pytest.mark.parametrize("fused", [False, True], ids=["cut_torch", "cut_kernel"])
@pytest.mark.parametrize("kind", ["flat", "peaked", "ties"])
@pytest.mark.parametrize("rows", [1, 7, 64, 256])
def test_sample_and_trainer_with_the_bound_equal_the_sort(rows, kind, fused, gpu_evidence):
    from true_on_policy.kernels.sampling import cut_kernel, sample, select_truncation, truncated_token_logprobs

    logits, temp, seeds, pos, (k, p, mp), (top_k, top_p, min_p) = _draw_case(kind, "qwen", rows, rows * 7)
    with select_truncation(False), cut_kernel(fused):
        sort = sample(logits, temp, seeds, pos, top_k=k, top_p=p, min_p=mp, truncating=True)
        top = sample(logits, temp, seeds, pos, top_k=k, top_p=p, min_p=mp, truncating=True, bound=top_k,
                     need_dist=True)  # top-k forming the [rows, vocab] logq (top log-probs asked)
        cut = sample(logits, temp, seeds, pos, top_k=k, top_p=p, min_p=mp, truncating=True, bound=top_k)
        what = f"{rows} rows, {kind}"
        for name, got in (("top-k", top), ("cut", cut)):
            _assert_ids(got[0], sort[0], f"sample ids, {name}, {what}")
            _assert_same(got[1], sort[1], f"sample log-probs, {name}, {what}")
        _assert_same(top[2], sort[2], f"sample dist, {what}")
        assert cut[2] is None  # the cut form: the draw forms logq itself
        scalar = truncated_token_logprobs(logits, top[0], temp, top_k, top_p, min_p)  # infers the bound: the cut
        tensor = truncated_token_logprobs(logits, top[0], temp, k, p, mp)  # the sort
    _assert_same(scalar, sort[1], f"trainer (top-k) == sampler (sort), {what}")
    _assert_same(tensor, cut[1], f"trainer (sort) == sampler (cut), {what}")
    gpu_evidence.append({"test": "truncation_top_sample_trainer", "rows": rows, "kind": kind, "cut_kernel": fused})


@pytest.mark.parametrize("fused", [False, True], ids=["cut_torch", "cut_kernel"])
@pytest.mark.parametrize("rows", [64, 256])
def test_sample_with_the_bound_replays_in_a_cuda_graph(rows, fused, gpu_evidence):
    import torch
    from true_on_policy.kernels.sampling import cut_kernel, sample, select_truncation

    def case(kind, seed):
        logits, temp, seeds, pos, _, _ = _draw_case(kind, "qwen", rows, seed)
        return (logits, temp, seeds, pos, *_bounded(rows, seed, 50))

    static = [t.clone() for t in case("flat", 5)]

    def draw(bound=50):
        lg, t, s, ps, kk, pp, mm = static
        return sample(lg, t, s, ps, top_k=kk, top_p=pp, min_p=mm, truncating=True, bound=bound)

    with select_truncation(False), cut_kernel(fused):
        graph, (g_ids, g_lp, _) = _captured(draw)  # the cut form; no host synchronisation in the draw
        for i, kind in enumerate(("flat", "peaked", "peaked", "ties")):
            for dst, src in zip(static, case(kind, 100 + i), strict=True):
                dst.copy_(src)
            graph.replay()
            torch.cuda.synchronize()
            ids, lp, _ = draw(None)  # eager, the sort
            _assert_ids(g_ids, ids, f"graph (cut) == eager sort, ids, replay {i} ({kind})")
            _assert_same(g_lp, lp, f"graph (cut) == eager sort, log-probs, replay {i} ({kind})")
    gpu_evidence.append({"test": "truncation_top_cuda_graph", "rows": rows, "replays": 4, "cut_kernel": fused})


@pytest.mark.parametrize("bound", [1, 20, 50, 1024])
@pytest.mark.parametrize("kind", ["flat", "peaked", "ties"])
@pytest.mark.parametrize("rows", [1, 7, 256])
def test_the_cut_kernel_equals_the_torch_cut_bitwise(rows, kind, bound, gpu_evidence):
    """``_cut_kernel`` (``cut_kernel(True)``) gives ``_top_cut``'s torch form's (edge, edge_id,
    log_total) bit for bit on every row, truncating or not, the scanned ones included."""
    import torch
    from true_on_policy.kernels import sampling as S

    logits, temp, _, _, _, _ = _draw_case(kind, "qwen", rows, rows * 11 + bound)
    kk, pp, mmp, need = S.truncation_params(rows, V, "cuda", *_bounded(rows, rows + bound, bound))
    t = S.temperatures(temp, rows, "cuda")
    lse = S.row_lse(S.shard_stats(logits, t, S.SHARDS))
    with S.cut_kernel(False):
        ref = S._top_cut(logits, t, lse, kk, pp, mmp, need, bound)
    with S.cut_kernel(True):
        got = S._top_cut(logits, t, lse, kk, pp, mmp, need, bound)
    for name, a, b in zip(("edge", "edge_id", "log_total"), got, ref, strict=True):
        assert torch.equal(a, b), f"{name}, {rows} rows, {kind}, bound {bound}: rows {(a != b).nonzero().tolist()}"
    gpu_evidence.append({"test": "cut_kernel_eq_torch_cut", "rows": rows, "kind": kind, "bound": bound})
