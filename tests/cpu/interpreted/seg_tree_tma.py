"""Interpreted (TRITON_INTERPRET=1): the seg_tree GEMM (segments as the loop, chunks + tail,
select fold) equals the fp64-per-segment reference exactly, plain and expert-grouped, for every
segment count and chunk split; a config key it does not know (the removed candidates' FOLD and
INNER) is refused; the grouped TMA GEMM (weights by tensor descriptor) equals the pointer kernel's
interpreted result (the same per-chunk rounding)."""
import sys

import torch

sys.path.insert(0, "tests")  # run with the checkout as cwd (see test_kernels_interpret.py)
from helpers import expect_value_errors  # noqa: E402
from true_on_policy.kernels import grouped_tma, seg_tree  # noqa: E402
from true_on_policy.kernels.matmul import ALIGN, COLUMN, _launch, matmul_reference
from true_on_policy.kernels.moe import align

g = torch.Generator().manual_seed(0)
for m, n, k, s, bk in ((5, 40, 768, 8, 64), (17, 24, 384, 4, 32), (3, 16, 512, 8, 64), (3, 16, 64, 1, 32),
                       (3, 16, 192, 2, 64), (2, 16, 96, 1, 64), (3, 16, 4096, 8, 64)):
    x = torch.randn(m, k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    cfg = dict(BLOCK_M=16, BLOCK_N=16, BK=bk, num_warps=4, num_stages=3)
    out = seg_tree.launch(x, w, torch.empty(m, n), None, None, m, s, cfg, dot_f32=True)
    assert torch.equal(out, matmul_reference(x, w, torch.float32, segments=s, acc=torch.float64)), (m, n, k, s, bk)
assert seg_tree.chunks_of(96, 64) == (1, 32) and seg_tree.chunks_of(96, 32) == (3, 0)
assert not seg_tree.fits(40, 32) and not seg_tree.fits(72, 64) and seg_tree.fits(32, 64)
# grouped: rows gathered through the expert table, per-expert weights
E, t, k, n = 4, 9, 768, 40
h = torch.randn(t * 2 + 50, k, generator=g).bfloat16()
we = (torch.randn(E, n, k, generator=g) * 0.05).bfloat16()
ids = torch.randint(0, E, (t, 2), generator=g, dtype=torch.int32)
rows, be, pos, own = align(ids, 0, E)
h = torch.randn(rows.shape[0], k, generator=g).bfloat16()
cfg = dict(BLOCK_M=32, BLOCK_N=32, BK=64, num_warps=4, num_stages=3)
bexp = be.repeat_interleave(ALIGN // 32)
out = seg_tree.launch(h, we, torch.empty(rows.shape[0], n), own, bexp, rows.shape[0], 8, cfg, dot_f32=True)
real = ((be >= 0).repeat_interleave(ALIGN) & (own >= 0)).nonzero()[:, 0]
for p in real.tolist():
    ref = matmul_reference(h[p:p + 1], we[be[p // ALIGN]], torch.float32, segments=8, acc=torch.float64)
    assert torch.equal(out[p:p + 1], ref), p
bad = [dict(cfg, FOLD="lag"), dict(cfg, INNER="loop")]  # the removed candidates' keys
expect_value_errors(*(lambda b=b: seg_tree.launch(x, w, torch.empty(m, n), None, None, m, 8, b) for b in bad))
assert not seg_tree.smem_ok(512, dict(cfg, BLOCK_M=64, BLOCK_N=128, num_stages=4))  # o_proj's 4096 / 8
assert seg_tree.smem_ok(96, dict(cfg, BLOCK_M=32, BLOCK_N=128, num_stages=3))  # ROW_SEG at 30B-A3B's 768 / 8
# grouped TMA == pointer kernel (gate/up form), N not a multiple of the tile
x = torch.randn(t, 128, generator=g).bfloat16()
w13 = (torch.randn(E, 48, 128, generator=g) * 0.05).bfloat16()
ref = _launch(x, w13, torch.empty(rows.shape[0], 48), rows, be, rows.shape[0], 1, COLUMN)
got = grouped_tma.launch(x, w13, torch.empty(rows.shape[0], 48), rows, be.repeat_interleave(ALIGN // 32),
                         rows.shape[0], dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=3))
used = (be >= 0).repeat_interleave(ALIGN) & (rows >= 0)
assert torch.equal(got[used], ref[used])
print("interpreted-ok")
