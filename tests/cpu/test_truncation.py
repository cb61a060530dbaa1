"""Truncated sampling (``kernels.sampling.truncate``) as a function of the row alone.

The rollout truncates with SGLang's batch tensors (top_p / min_p in fp32, one row or many per
call); the trainer with the Python floats of ``meta_info.sampling_params_used`` (one sequence's
rows, in chunks). Both must cut at the same token and renormalise by the same kept mass, bit for
bit. The GPU tier repeats the batch-composition test on CUDA (``tests/gpu/test_truncation_gpu.py``).
"""

import pytest
import torch
from true_on_policy.kernels.sampling import MASS_BITS, truncate


def _row_with_mass_before(first: float, vocab: int = 6) -> torch.Tensor:
    """fp32 log-probs whose top token has probability ``first`` (after fp32 rounding of its log)."""
    rest = (1.0 - first) / (vocab - 1)
    p = torch.tensor([first] + [rest] * (vocab - 1), dtype=torch.float64)
    return p.log().float()[None, :]


def test_top_p_is_cut_at_its_fp32_value_whether_given_as_float_or_fp32_tensor():
    # the second token's exclusive cumulative mass lies strictly between fp32(0.9) and 0.9, where a
    # threshold compared in fp64 (0.9) keeps it and SGLang's fp32 one (0.89999998) drops it
    logp = _row_with_mass_before(0.8999999881)
    before = float(logp[0, 0].double().exp())
    assert float(torch.tensor(0.9, dtype=torch.float32)) < before <= 0.9  # the window is hit
    as_float = truncate(logp, top_p=0.9)
    as_fp32 = truncate(logp, top_p=torch.tensor([0.9], dtype=torch.float32))
    assert torch.equal(as_float, as_fp32)
    assert torch.isfinite(as_float).sum() == 1  # cut at fp32(0.9): only the top token is kept
    assert abs(float(as_float[0, 0])) < 1e-12  # renormalised over the one kept token


def test_min_p_is_judged_at_its_fp32_value():
    # fp32(0.3) rounds up: a token with p / p_max in [0.3, fp32(0.3)) is kept by an fp64 threshold
    # and dropped by SGLang's fp32 one. p_1 = fp32 log(0.3); p_max = exp(a) with a near 0, where
    # fp32 steps are fine enough to land the ratio in the window.
    lo, hi = 0.3, float(torch.tensor(0.3, dtype=torch.float32))
    b = torch.tensor(0.3, dtype=torch.float64).log().float()
    a = (b.double() - torch.tensor((lo + hi) / 2, dtype=torch.float64).log()).float()
    logp = torch.stack([a, b, torch.tensor(-5.0)])[None, :]
    got = logp.double().exp()[0]
    assert lo * float(got[0]) <= float(got[1]) < hi * float(got[0])  # the window is hit
    as_float, as_fp32 = truncate(logp, min_p=0.3), truncate(logp, min_p=torch.tensor([0.3], dtype=torch.float32))
    assert torch.equal(as_float, as_fp32)
    assert not torch.isfinite(as_float[0, 1])  # judged at fp32(0.3): dropped


def test_kept_mass_is_an_exact_integer_sum():
    g = torch.Generator().manual_seed(0)
    logp = torch.log_softmax(torch.randn(3, 4099, generator=g) * 3, dim=-1)
    prob = torch.sort(logp, dim=-1, descending=True, stable=True).values.double().exp()
    mass = (prob * 2.0 ** MASS_BITS).to(torch.int64)
    forward = torch.cumsum(mass, dim=-1)[:, -1]
    backward = torch.cumsum(mass.flip(-1), dim=-1)[:, -1]
    assert torch.equal(forward, backward)  # any summation order: the same integer
    assert int(forward.max()) < 2 ** 63 - 1


def _logits(kind: str, rows: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g)
    return x * (0.05 if kind == "flat" else 4.0)  # flat: many tokens near the cut; peaked: a few


SETTINGS = {
    "none": {},
    "top_k": {"top_k": 20},
    "top_p": {"top_p": 0.9},
    "min_p": {"min_p": 0.05},
    "mixed": "mixed",
}


def _others(kind, rows, vocab, seed):
    """Per-row settings of the other rows: one setting for all, or a mix (top_k -1/5/50, top_p
    0.5..1, min_p 0/0.05)."""
    if kind != "mixed":
        return SETTINGS[kind]
    g = torch.Generator().manual_seed(seed)
    return {"top_k": torch.tensor([-1, 5, 50, 1])[torch.randint(0, 4, (rows,), generator=g)],
            "top_p": torch.tensor([0.5, 0.8, 0.9, 0.95, 0.99, 1.0], dtype=torch.float32)[
                torch.randint(0, 6, (rows,), generator=g)],
            "min_p": torch.tensor([0.0, 0.05], dtype=torch.float32)[torch.randint(0, 2, (rows,), generator=g)]}


@pytest.mark.parametrize("kind", ["flat", "peaked"])
@pytest.mark.parametrize("others", list(SETTINGS))
def test_a_row_truncates_alike_alone_and_in_any_batch(kind, others):
    vocab = 3001
    row = torch.log_softmax(_logits(kind, 1, vocab, 7) / 0.7, dim=-1)
    mine = {"top_k": 50, "top_p": 0.9, "min_p": 0.05}
    alone = truncate(row, **mine)
    for batch, pos in ((2, 1), (7, 3), (64, 0), (255, 254), (256, 131)):
        logp = torch.log_softmax(_logits(kind, batch, vocab, batch) / 0.7, dim=-1)
        logp[pos] = row[0]
        cfg = _others(others, batch, vocab, batch)
        per_row = {}
        for name, value in mine.items():
            other = cfg.get(name)
            default = {"top_k": -1, "top_p": 1.0, "min_p": 0.0}[name]
            t = (other.clone() if isinstance(other, torch.Tensor) else
                 torch.full((batch,), default if other is None else other,
                            dtype=torch.int64 if name == "top_k" else torch.float32))
            t[pos] = value
            per_row[name] = t
        got = truncate(logp, **per_row)
        assert torch.equal(got[pos], alone[0]), (batch, pos, others)
