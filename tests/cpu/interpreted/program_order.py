"""Interpreted (TRITON_INTERPRET=1): the order of the grouped GEMMs' programs (``matmul.program_tile``, the
launchers' ``group``) changes no bit. The grouped TMA GEMM (one tile per program and the block loop, the plain
and the GLU form) and the grouped tree GEMM, launched in groups of 1, 2, 3 and 8 M blocks (the last group short:
the M blocks are not a multiple of 3 or 8), give exactly the outputs of the 2-D grid's column order, and every
row the table uses is written (the output starts as NaN)."""
import torch
from true_on_policy.kernels import grouped_tma, seg_tree
from true_on_policy.kernels.matmul import ALIGN, MOE_GROUP_M
from true_on_policy.kernels.moe import align

g = torch.Generator().manual_seed(0)
E, T, TOP, N, K = 5, 70, 2, 48, 128
ids = torch.stack([torch.randperm(E, generator=g)[:TOP] for _ in range(T)]).int()
rows, be, _, own = align(ids, 0, E)
used = (be >= 0).repeat_interleave(ALIGN) & (rows >= 0)
x = torch.randn(T, K, generator=g).bfloat16()
w = (torch.randn(E, N, K, generator=g) * 0.05).bfloat16()
tile = dict(BLOCK_M=32, BLOCK_N=16, BLOCK_K=64, num_warps=4, num_stages=3)
GROUPS = sorted({1, 2, 3, 8, MOE_GROUP_M})  # and the rollout's group size, whatever it is
assert (rows.shape[0] // tile["BLOCK_M"]) % 3 and (rows.shape[0] // tile["BLOCK_M"]) % 8  # a short last group


def grouped(group, sub=1, glu=False):
    b = be.repeat_interleave(ALIGN // (tile["BLOCK_M"] * sub))
    out = torch.full((rows.shape[0], N // 2 if glu else N), float("nan"))
    return grouped_tma.launch(x, w, out, rows, b, rows.shape[0], tile, dot_step=16, subtiles=sub, glu=glu,
                              group=group)


for sub in (1, ALIGN // tile["BLOCK_M"]):
    for glu in (False, True):
        want = grouped(0, sub, glu)
        assert not want[used].isnan().any(), (sub, glu)
        for group in GROUPS:
            got = grouped(group, sub, glu)
            assert torch.equal(got[used], want[used]), ("grouped_tma", group, sub, glu)

# the grouped tree GEMM (v1's down projection): h [P, K] through the table's own rows, 8 segments
h = torch.randn(rows.shape[0], K, generator=g).bfloat16()
seg = dict(BLOCK_M=32, BLOCK_N=16, BK=16, num_warps=4, num_stages=3)
mask = (be >= 0).repeat_interleave(ALIGN) & (own >= 0)


def tree(group):
    b = be.repeat_interleave(ALIGN // seg["BLOCK_M"])
    out = torch.full((rows.shape[0], N), float("nan"))
    return seg_tree.launch(h, w, out, own, b, rows.shape[0], 8, seg, dot_f32=True, group=group)


want = tree(0)
assert not want[mask].isnan().any()
for group in GROUPS:
    assert torch.equal(tree(group)[mask], want[mask]), ("seg_tree", group)
print("interpreted-ok")
