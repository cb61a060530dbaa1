"""Interpreted (TRITON_INTERPRET=1): the segment-tree GEMM with its top levels across programs
(``seg_split``) equals the fp64-per-segment reference and ``seg_tree`` exactly, plain and
expert-grouped, for every part count and both arrival orders, and leaves its arrival counters at
zero; parts that do not divide the segments, or a config key it does not know, are refused."""
import torch
from true_on_policy.kernels import seg_split, seg_tree
from true_on_policy.kernels.matmul import ALIGN, matmul_reference
from true_on_policy.kernels.moe import align

g = torch.Generator().manual_seed(0)
for m, n, k, s, bk in ((5, 40, 768, 8, 64), (17, 24, 384, 4, 32), (3, 16, 512, 8, 64), (3, 16, 192, 2, 64)):
    x = torch.randn(m, k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    cfg = dict(BLOCK_M=16, BLOCK_N=16, BK=bk, num_warps=4, num_stages=3)
    ref = matmul_reference(x, w, torch.float32, segments=s, acc=torch.float64)
    assert torch.equal(seg_tree.launch(x, w, torch.empty(m, n), None, None, m, s, cfg, dot_f32=True), ref)
    for parts in (1, 2, 4, 8):
        if s % parts:
            continue
        for reverse in (False, True):
            out = seg_split.launch(x, w, torch.full((m, n), float("nan")), None, None, m, s, parts, cfg,
                                   dot_f32=True, reverse=reverse)
            assert torch.equal(out, ref), (m, n, k, s, bk, parts, reverse)
            assert not seg_split.counters(x.device, 1).any(), "an arrival counter left non-zero"
# grouped: rows gathered through the expert table, per-expert weights
E, t, k, n = 4, 9, 768, 40
we = (torch.randn(E, n, k, generator=g) * 0.05).bfloat16()
ids = torch.randint(0, E, (t, 2), generator=g, dtype=torch.int32)
rows, be, pos, own = align(ids, 0, E)
h = torch.randn(rows.shape[0], k, generator=g).bfloat16()
cfg = dict(BLOCK_M=32, BLOCK_N=32, BK=64, num_warps=4, num_stages=3)
bexp = be.repeat_interleave(ALIGN // 32)
real = ((be >= 0).repeat_interleave(ALIGN) & (own >= 0)).nonzero()[:, 0]
want = seg_tree.launch(h, we, torch.empty(rows.shape[0], n), own, bexp, rows.shape[0], 8, cfg, dot_f32=True)
for parts in (2, 4):
    out = seg_split.launch(h, we, torch.empty(rows.shape[0], n), own, bexp, rows.shape[0], 8, parts, cfg, dot_f32=True,
                           reverse=parts == 4)
    assert torch.equal(out[real], want[real]), parts
for p in real.tolist()[:8]:
    ref = matmul_reference(h[p:p + 1], we[be[p // ALIGN]], torch.float32, segments=8, acc=torch.float64)
    assert torch.equal(out[p:p + 1], ref), p
assert not seg_split.counters(h.device, 1).any()
for bad in (dict(parts=3), dict(parts=16), dict(cfg=dict(cfg, FOLD="lag"))):
    try:
        seg_split.launch(x, w, torch.empty(m, n), None, None, m, 8, bad.get("parts", 2), bad.get("cfg", cfg))
    except ValueError:
        pass
    else:
        raise AssertionError(bad)
print("interpreted-ok")
