"""GPU tier: the selection kernel ``truncate_select`` equals ``truncate`` bitwise at the real vocabulary.

Rows are the sampler's own log-probs (``log_softmax_rows``) of flat logits (many tokens near every
cut) and peaked ones, V = 151 936, batches of 1 .. 256 rows with mixed top_k / top_p / min_p in
the forms SGLang passes (int32 top_k, fp32 top_p / min_p), plus Python floats. Asserted bitwise:
the whole fp32 logq, so the kept set, the kept mass and every value; the same for other launch
shapes (chunk width, search arity, warps) and for a CUDA-graph replay. Speed is not tested here:
``benchmarks/truncation.py``.

The switch (``kernels.sampling.select_truncation``): the rollout's ``sample`` and the trainer's
``truncated_token_logprobs`` with the selection kernel on == off, bitwise (ids, log-probs, the
distribution drawn from), at batches 1, 7, 64 and 256 with Qwen3's top_k 20 / top_p 0.95, top_p
0.9, min_p 0.05 and mixed rows (greedy and untruncated ones among them: logp itself); the trainer
== the sampler whichever path each took; ``sample`` with the switch on captured in a CUDA graph
and replayed == eager, with no host synchronisation. These decide whether ``SELECT_ON_CUDA`` may
default to on.
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


def _sort(logp, *params):
    """``truncate`` by its sort, whatever ``SELECT_ON_CUDA``'s default: the reference here."""
    from true_on_policy.kernels.sampling import select_truncation, truncate

    with select_truncation(False):
        return truncate(logp, *params)


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
    from true_on_policy.kernels.truncation import truncate_select

    logp = _logp(kind, rows, rows * 13 + (kind == "flat"))
    k, p, mp = _mixed(rows, rows)
    want = _sort(logp, k, p, mp)
    _assert_same(truncate_select(logp, k, p, mp), want, f"{rows} rows {kind}")
    _assert_same(truncate_select(logp[:1].clone(), k[:1], p[:1], mp[:1]), want[:1], "the first row alone")


@pytest.mark.parametrize("top_k, top_p, min_p", [(20, 0.95, 0.0), (-1, 0.9, 0.0), (-1, 1.0, 0.05), (50, 0.8, 0.05)])
def test_select_equals_truncate_with_python_floats(top_k, top_p, min_p):
    from true_on_policy.kernels.truncation import truncate_select

    for kind in ("flat", "peaked"):
        logp = _logp(kind, 16, 7)
        _assert_same(truncate_select(logp, top_k, top_p, min_p), _sort(logp, top_k, top_p, min_p), kind)


def test_launch_shapes_and_graph_replay_give_the_same_bits():
    import torch
    from true_on_policy.kernels.truncation import truncate_select

    logp = torch.cat([_logp("flat", 32, 1), _logp("peaked", 32, 2)])
    k, p, mp = _mixed(64, 3)
    want = _sort(logp, k, p, mp)
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
    _assert_same(out, _sort(static, k, p, mp), "graph replay")


SWITCH_SETTINGS = {"qwen": (20, 0.95, 0.0), "top_p": (-1, 0.9, 0.0), "min_p": (-1, 1.0, 0.05), "mixed": None}


def _draw_case(kind, setting, rows, seed):
    """Logits, per-row T / seed / position and top_k / top_p / min_p in SGLang's tensor forms, and the
    trainer's form (Python numbers for one setting, the tensors for mixed rows)."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    if kind == "ties":  # four values: every cut falls inside a tie far wider than any top_k
        logits = torch.randint(0, 4, (rows, V), generator=g, device="cuda").float() * 0.5
    else:
        logits = torch.randn(rows, V, generator=g, device="cuda") * (0.05 if kind == "flat" else 4.0)
    temp = torch.rand(rows, generator=g, device="cuda") + 0.5
    seeds = torch.randint(-2 ** 62, 2 ** 62, (rows,), generator=g, device="cuda")
    pos = torch.randint(0, 40000, (rows,), generator=g, device="cuda")
    if SWITCH_SETTINGS[setting] is None:
        k, p, mp = _mixed(rows, seed)
        return logits, temp, seeds, pos, (k, p, mp), (k, p, mp)
    top_k, top_p, min_p = SWITCH_SETTINGS[setting]
    k = torch.full((rows,), V if top_k < 0 else top_k, dtype=torch.int32, device="cuda")
    p = torch.full((rows,), top_p, dtype=torch.float32, device="cuda")
    mp = torch.full((rows,), min_p, dtype=torch.float32, device="cuda")
    return logits, temp, seeds, pos, (k, p, mp), (top_k, top_p, min_p)


def _both(monkeypatch, fn):
    """fn() with the switch off (the sort), then on (the selection kernel; the sort refused)."""
    from true_on_policy.kernels import sampling
    from true_on_policy.kernels.sampling import select_truncation

    with select_truncation(False):
        off = fn()

    def refuse(*a, **kw):
        raise AssertionError("the sort ran with the switch on")

    with monkeypatch.context() as m, select_truncation(True):
        m.setattr(sampling, "_truncate_rows", refuse)
        on = fn()
    return off, on


def _assert_ids(got, want, what):
    import torch

    if not torch.equal(got, want):
        raise AssertionError(f"{what}: {int((got != want).sum())} of {got.numel()} ids differ")


@pytest.mark.parametrize("kind", ["flat", "peaked"])
@pytest.mark.parametrize("setting", list(SWITCH_SETTINGS))
@pytest.mark.parametrize("rows", [1, 7, 64, 256])
def test_switch_on_and_off_give_the_same_sample_and_trainer_bits(rows, setting, kind, monkeypatch, gpu_evidence):
    import torch
    from true_on_policy.kernels.sampling import log_softmax_rows, sample, truncated_token_logprobs

    logits, temp, seeds, pos, (k, p, mp), trainer = _draw_case(kind, setting, rows, rows * 31 + len(setting))
    off, on = _both(monkeypatch, lambda: sample(logits, temp, seeds, pos, top_k=k, top_p=p, min_p=mp,
                                                truncating=True))
    what = f"{rows} rows, {setting}, {kind}"
    _assert_ids(on[0], off[0], f"sample ids, {what}")
    _assert_same(on[1], off[1], f"sample log-probs, {what}")
    _assert_same(on[2], off[2], f"sample dist, {what}")
    plain = ~(((k > 1) & (k < V)) | (p < 1.0) | (mp > 0.0)) | (k == 1)  # greedy or nothing to cut
    if bool(plain.any()):
        _assert_same(on[2][plain], log_softmax_rows(logits, temp)[plain], f"untruncated rows are logp, {what}")
    ids = on[0]
    t_off, t_on = _both(monkeypatch, lambda: truncated_token_logprobs(logits, ids, temp, *trainer))
    _assert_same(t_on, t_off, f"trainer, {what}")
    _assert_same(t_off, on[1], f"trainer (sort) == sampler (selection), {what}")
    _assert_same(t_on, off[1], f"trainer (selection) == sampler (sort), {what}")
    kept = torch.isfinite(on[2]).sum(dim=1)
    gpu_evidence.append({"test": "truncation_switch_same_bits", "rows": rows, "setting": setting, "kind": kind,
                         "kept_min": int(kept.min()), "kept_max": int(kept.max())})


def _captured(draw):
    """``draw()`` once outside the capture (compilation), once more with any host synchronisation
    raising, then captured in a CUDA graph: (graph, the graph's outputs)."""
    import torch

    draw()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        draw()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = draw()
    return graph, out


@pytest.mark.parametrize("rows", [64, 256])
def test_sample_with_the_switch_on_replays_in_a_cuda_graph(rows, gpu_evidence):
    import torch
    from true_on_policy.kernels.sampling import sample, select_truncation

    logits, temp, seeds, pos, (k, p, mp), _ = _draw_case("flat", "mixed", rows, 5)
    static = [t.clone() for t in (logits, temp, seeds, pos, k, p, mp)]

    def draw():
        lg, t, s, ps, kk, pp, mm = static
        return sample(lg, t, s, ps, top_k=kk, top_p=pp, min_p=mm, truncating=True)

    with select_truncation(True):
        graph, (g_ids, g_lp, g_dist) = _captured(draw)
        for i, kind in enumerate(("flat", "peaked", "peaked")):
            new = _draw_case(kind, "mixed", rows, 100 + i)
            for dst, src in zip(static, (*new[:4], *new[4]), strict=True):
                dst.copy_(src)
            graph.replay()
            torch.cuda.synchronize()
            ids, lp, dist = draw()  # eager, the switch on
            _assert_ids(g_ids, ids, f"graph ids, replay {i}")
            _assert_same(g_lp, lp, f"graph log-probs, replay {i}")
            _assert_same(g_dist, dist, f"graph dist, replay {i}")
    with select_truncation(False):
        ids, lp, dist = draw()  # eager, the sort
    _assert_ids(g_ids, ids, "graph (selection) == eager sort, ids")
    _assert_same(g_lp, lp, "graph (selection) == eager sort, log-probs")
    _assert_same(g_dist, dist, "graph (selection) == eager sort, dist")
    gpu_evidence.append({"test": "truncation_switch_cuda_graph", "rows": rows, "replays": 3})
