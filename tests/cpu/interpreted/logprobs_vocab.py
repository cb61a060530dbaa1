"""Interpreted: token log-probs and the sampler for any vocabulary size (shards of ceil(V/8), the
last shorter or empty): V = 3001, 151936 (a few rows) and tiny V vs the reference; batch
invariance; a padded slice (NaN in the padding, as a padded lm_head may leave) == the unpadded
logits, contiguous or strided; vocab-parallel t = 2, 4, 8 simulated over the padded vocabulary
== one process, bitwise; V % 8 == 0 keeps its equal shards."""
import sys

import torch

sys.path.insert(0, "tests")  # run with the checkout as cwd (see test_kernels_interpret.py)
from helpers import expect_value_errors  # noqa: E402
from true_on_policy.kernels.logprobs import (  # noqa: E402
    SHARDS,
    _layout,
    finish,
    shard_size,
    shard_stats,
    temperatures,
    token_logprobs,
    token_logprobs_reference,
    token_z,
)
from true_on_policy.kernels.sampling import (  # noqa: E402
    log_softmax_rows,
    sample,
    sample_reference,
    truncate,
    truncated_token_logprobs,
)

g = torch.Generator().manual_seed(21)
assert shard_size(151936) == 151936 // 8 and shard_size(3001) == 376 and shard_size(5) == 1
for V, R in ((3001, 9), (151936, 2), (5, 4), (57, 4), (49, 3), (1, 2)):
    logits = torch.randn(R, V, generator=g) * 4
    tok = torch.randint(0, V, (R,), generator=g)
    temp = torch.linspace(0.5, 1.5, R)
    lp = token_logprobs(logits, tok, temp)
    torch.testing.assert_close(lp, token_logprobs_reference(logits, tok, temp[:, None]), rtol=1e-5, atol=2e-5)
    for n in (1, R - 1):  # batch invariance
        assert torch.equal(token_logprobs(logits[:n].clone(), tok[:n].clone(), temp[:n]), lp[:n]), (V, n)
    # a padded slice: SGLang's lm_head output before the slice to vocab_size (here NaN-filled padding)
    S = shard_size(V)
    padded = torch.full((R, 8 * S + 64), float("nan"))
    padded[:, :V] = logits
    assert torch.equal(token_logprobs(padded, tok, temp, vocab=V), lp), (V, "padded")
    assert torch.equal(token_logprobs(padded[:, :V], tok, temp), lp), (V, "strided view")
    # vocab-parallel t = 2, 4, 8 over the vocabulary padded to 8 * S: each rank's whole shards
    z = token_z(logits, tok, temperatures(temp, R, logits.device))
    for t in (2, 4, 8):
        w = (SHARDS // t) * S
        assert _layout(w, t, V) == (V, S)
        stats = torch.cat([shard_stats(padded[:, r * w:(r + 1) * w].contiguous(), temp, SHARDS // t, S,
                                       min(max(V - r * w, 0), w)) for r in range(t)], 1)
        z_t = sum(token_z(padded[:, r * w:(r + 1) * w].contiguous(), tok, temperatures(temp, R, logits.device), r * w)
                  for r in range(t))
        assert torch.equal(z_t, z) and torch.equal(finish(stats, z_t), lp), (V, t)
    # the sampler on the same vocabulary: the report is token_logprobs, the draw the reference's
    seeds, pos = torch.arange(R) * 7 + 1, torch.arange(R) + 3
    ids, slp, _ = sample(logits, temp, seeds, pos)
    assert torch.equal(slp, token_logprobs(logits, ids, temp)), V
    logp = log_softmax_rows(logits, temp)
    assert torch.equal(ids, sample_reference(logp, logits, seeds, pos, torch.zeros(R, dtype=torch.bool))), V
    assert torch.equal(logp.gather(1, tok[:, None])[:, 0], lp), V
    ids_s, slp_s, _ = sample(padded[:, :V], temp, seeds, pos)
    assert torch.equal(ids_s, ids) and torch.equal(slp_s, slp), (V, "strided sampler")
    if V > 20:
        ti, tlp, _ = sample(logits, temp, seeds, pos, top_k=20, top_p=0.9)  # the cut form (a scalar top_k)
        logq = truncate(logp, 20, 0.9)
        assert torch.equal(tlp, truncated_token_logprobs(logits, ti, temp, 20, 0.9)), V
        assert torch.equal(ti, sample_reference(logq, logits, seeds, pos, torch.zeros(R, dtype=torch.bool))), V

# V % 8 == 0: the shards are the old equal ones (V/8 each; stats of any split into whole shards agree)
logits = torch.randn(3, 4096 + 8, generator=g)
st = shard_stats(logits, 1.0, SHARDS)
assert torch.equal(st[:, :4], shard_stats(logits[:, :2052].contiguous(), 1.0, 4))
expect_value_errors(lambda: _layout(1500, 2, 3001), lambda: _layout(3000, 1, 3001),
                    lambda: shard_stats(logits, 1.0, 8, 10, 4104),
                    lambda: token_logprobs(logits, torch.tensor([0, 1, 4104]), 1.0),
                    lambda: token_logprobs(padded, torch.zeros(padded.shape[0], dtype=torch.long), 1.0, vocab=0))
print("interpreted-ok")
