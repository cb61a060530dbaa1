"""GPU tier: the selection kernel ``truncate_select`` equals ``truncate`` bitwise at the real vocabulary.

Rows are the sampler's own log-probs (``log_softmax_rows``) of flat logits (many tokens near every
cut) and peaked ones, V = 151 936, batches of 1 .. 256 rows with mixed top_k / top_p / min_p in
the forms SGLang passes (int32 top_k, fp32 top_p / min_p), plus Python floats. Asserted bitwise:
the whole fp32 logq, so the kept set, the kept mass and every value; the same for other launch
shapes (chunk width, search arity, warps) and for a CUDA-graph replay. Speed is not tested here:
``benchmarks/truncation.py``.
"""

import pytest

pytestmark = pytest.mark.gpu
V = 151936


def _logp(kind, rows, seed):
    import torch
    from true_on_policy.kernels.sampling import log_softmax_rows

    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, V, generator=g, device="cuda") * (0.05 if kind == "flat" else 4.0)
    return log_softmax_rows(x, 1.0)


def _mixed(rows, seed):
    import torch

    g = torch.Generator().manual_seed(seed)
    k = torch.tensor([V, 1, 5, 20, 50, -1, V + 1], dtype=torch.int32)[torch.randint(0, 7, (rows,), generator=g)]
    p = torch.tensor([0.5, 0.8, 0.9, 0.95, 0.99, 1.0])[torch.randint(0, 6, (rows,), generator=g)]
    mp = torch.tensor([0.0, 0.0, 0.05, 0.3])[torch.randint(0, 4, (rows,), generator=g)]
    return k.cuda(), p.float().cuda(), mp.float().cuda()


def _assert_same(got, want, what):
    import torch

    if not torch.equal(got, want):
        kept = int((torch.isfinite(got) != torch.isfinite(want)).sum())
        both = torch.isfinite(got) & torch.isfinite(want)
        delta = float((got[both].double() - want[both].double()).abs().max()) if both.any() else 0.0
        raise AssertionError(f"{what}: {int((got != want).sum())} differ, {kept} in the kept set, max |Δ| {delta:g}")


@pytest.mark.parametrize("kind", ["flat", "peaked"])
@pytest.mark.parametrize("rows", [1, 2, 7, 64, 255, 256])
def test_select_equals_truncate_bitwise(rows, kind):
    from true_on_policy.kernels.sampling import truncate
    from true_on_policy.kernels.truncation import truncate_select

    logp = _logp(kind, rows, rows * 13 + (kind == "flat"))
    k, p, mp = _mixed(rows, rows)
    want = truncate(logp, k, p, mp)
    _assert_same(truncate_select(logp, k, p, mp), want, f"{rows} rows {kind}")
    _assert_same(truncate_select(logp[:1].clone(), k[:1], p[:1], mp[:1]), want[:1], "the first row alone")


@pytest.mark.parametrize("top_k, top_p, min_p", [(20, 0.95, 0.0), (-1, 0.9, 0.0), (-1, 1.0, 0.05), (50, 0.8, 0.05)])
def test_select_equals_truncate_with_python_floats(top_k, top_p, min_p):
    from true_on_policy.kernels.sampling import truncate
    from true_on_policy.kernels.truncation import truncate_select

    for kind in ("flat", "peaked"):
        logp = _logp(kind, 16, 7)
        _assert_same(truncate_select(logp, top_k, top_p, min_p), truncate(logp, top_k, top_p, min_p), kind)


def test_launch_shapes_and_graph_replay_give_the_same_bits():
    import torch
    from true_on_policy.kernels.sampling import truncate
    from true_on_policy.kernels.truncation import truncate_select

    logp = torch.cat([_logp("flat", 32, 1), _logp("peaked", 32, 2)])
    k, p, mp = _mixed(64, 3)
    want = truncate(logp, k, p, mp)
    for block, ways, warps in ((256, 2, 4), (512, 4, 4), (1024, 16, 8), (2048, 8, 8), (4096, 32, 16)):
        _assert_same(truncate_select(logp, k, p, mp, block=block, ways=ways, num_warps=warps), want,
                     f"block {block} ways {ways} warps {warps}")
    static = logp.clone()
    truncate_select(static, k, p, mp)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = truncate_select(static, k, p, mp)
    static.copy_(_logp("peaked", 64, 4))
    graph.replay()
    _assert_same(out, truncate(static, k, p, mp), "graph replay")
