"""Interpreted (TRITON_INTERPRET=1): the expert table ``align`` equals the stable-argsort reference
(rows of used blocks, block experts, slot positions), one process and an EP slice, including an
expert holding more than ALIGN slots, absent experts and no tokens, in both forms (one launch that
counts in the align kernel up to NBLOCK slots, the count kernel first above); and the combine
gives the same bits at every column width per program (the candidates gemm_sweep times)."""
import sys

import torch

sys.path.insert(0, "tests")  # run with the checkout as cwd (see test_kernels_interpret.py)
from helpers import assert_align_table  # noqa: E402
from true_on_policy.kernels.matmul import ALIGN  # noqa: E402
from true_on_policy.kernels.moe import align  # noqa: E402

g = torch.Generator().manual_seed(0)
cases = []
for t, k, e in ((1, 8, 16), (5, 2, 8), (64, 8, 16), (300, 4, 8), (520, 4, 8)):  # the last: 2080 > NBLOCK slots
    cases.append(torch.randint(0, e, (t, k), generator=g, dtype=torch.int32))
crowded = torch.randint(0, 8, (90, 2), generator=g, dtype=torch.int32)
crowded[:, 0] = 3  # expert 3 gets 90+ slots: two blocks
cases.append(crowded)
cases.append(torch.zeros(0, 8, dtype=torch.int32))
for ids in cases:
    e = int(ids.max()) + 1 if ids.numel() else 8
    for first, local in ((0, e), (e // 2, e - e // 2), (0, max(e // 4, 1))):  # one process, EP slices
        assert_align_table(ids, first, local)
from true_on_policy.kernels.moe import combine  # noqa: E402

ids = torch.randint(0, 16, (37, 4), generator=torch.Generator().manual_seed(2), dtype=torch.int32)
ref = align(ids, 0, 16)
for nb in (64, 128, 256, 2048):  # nor on the slots scanned per step (64, 128: two launches; above: one)
    got = align(ids, 0, 16, nblock=nb)
    used = (ref[1] >= 0).repeat_interleave(ALIGN)
    assert torch.equal(got[1], ref[1]) and torch.equal(got[2], ref[2]), nb
    assert torch.equal(got[0][used], ref[0][used]) and torch.equal(got[3][used], ref[3][used]), nb

g = torch.Generator().manual_seed(1)
e_out = torch.randn(40, 300, generator=g)  # fp32, as the down tree writes it
pos = torch.randint(0, 40, (6, 4), generator=g)
w = torch.rand(6, 4, generator=g)
ref = combine(e_out, pos, w)
for hb in (64, 128, 256, 512):
    assert torch.equal(combine(e_out, pos, w, hblock=hb), ref), hb
print("interpreted-ok")
