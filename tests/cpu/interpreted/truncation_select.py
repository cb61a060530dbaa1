"""Interpreted: ``truncate_select`` (the Triton selection kernel) equals ``truncate`` bitwise on
flat, peaked, tied and masked rows with mixed top_k / top_p / min_p, for several chunk widths and
search arities (the bits must not depend on them), and a row alone equals the row in the batch."""
import itertools
import sys

import torch

sys.path.insert(0, "tests")  # run with the checkout as cwd (see test_kernels_interpret.py)
from helpers import expect_value_errors, truncation_rows  # noqa: E402
from true_on_policy.kernels.sampling import truncate  # noqa: E402
from true_on_policy.kernels.truncation import truncate_select  # noqa: E402

g = torch.Generator().manual_seed(0)


def rows_of(kind, rows, vocab):
    return torch.log_softmax(truncation_rows(g, kind, rows, vocab), dim=-1)


def check(got, want, what):
    if not torch.equal(got, want):
        kept = int((torch.isfinite(got) != torch.isfinite(want)).sum())
        raise AssertionError(f"{what}: {int((got != want).sum())} differ, {kept} in the kept set")


for vocab, kind in [(1, "flat"), (2, "peaked"), (7, "ties"), (37, "flat"), (100, "ties"), (100, "masked"),
                    (300, "peaked")]:
    combos = list(itertools.product((-1, 1, 5, vocab), (0.5, 0.9, 1.0), (0.0, 0.3)))
    k = torch.tensor([c[0] for c in combos])
    p = torch.tensor([c[1] for c in combos], dtype=torch.float32)
    mp = torch.tensor([c[2] for c in combos], dtype=torch.float32)
    logp = rows_of(kind, len(combos), vocab)
    want = truncate(logp, k, p, mp)
    check(truncate_select(logp, k, p, mp, block=256, ways=16), want, f"V={vocab} {kind}")
    if kind in ("ties", "masked"):  # other chunk widths and arities, on some rows (the interpreter is slow)
        sel = torch.randperm(len(combos), generator=g)[:6]
        for block, ways in ((16, 2), (32, 4)):
            check(truncate_select(logp[sel], k[sel], p[sel], mp[sel], block=block, ways=ways), want[sel],
                  f"V={vocab} {kind} {block} {ways}")

logp = rows_of("peaked", 5, 200)
want = truncate(logp, 20, 0.9, 0.05)  # Python floats
check(truncate_select(logp, 20, 0.9, 0.05), want, "scalars")
for n in (1, 2):  # a row alone == the row in the batch
    check(truncate_select(logp[n:n + 1].clone(), 20, 0.9, 0.05), want[n:n + 1], f"row {n} alone")
wide = torch.full((3, 400), float("nan"))
wide[:, :200] = logp[:3]  # strided rows: the first 200 columns of a wider buffer
check(truncate_select(wide[:, :200], 20, 0.9, 0.05), want[:3], "strided rows")
expect_value_errors(lambda: truncate_select(logp.double()), lambda: truncate_select(logp, block=48),
                    lambda: truncate_select(logp, ways=1))
print("interpreted-ok")
