"""Token embedding: an exact row lookup, so there is no Triton kernel -- only the statement.

Math: out[t] = W[ids[t]] (a copy: no arithmetic, no rounding). Vocab-parallel form: rank r holds
rows [lo, hi); it returns W_r[ids - lo] where lo <= ids < hi and exact zeros elsewhere, so the
sum over ranks (any order, any NCCL algorithm) is the row itself: x + 0 == x. SGLang's
``VocabParallelEmbedding`` and torch's ``nn.Embedding`` (the trainer) compute exactly this, which
is why both sides keep their own module for this op.
"""

from __future__ import annotations

import torch


def embedding_reference(ids: torch.Tensor, weight: torch.Tensor, vocab_start: int = 0) -> torch.Tensor:
    """ids [...] (global token ids), weight [rows, H] (this rank's rows from ``vocab_start``)."""
    local = ids.long() - vocab_start
    mine = (local >= 0) & (local < weight.shape[0])
    out = weight[local.clamp(0, weight.shape[0] - 1)]
    return torch.where(mine[..., None], out, torch.zeros((), dtype=weight.dtype, device=weight.device))
