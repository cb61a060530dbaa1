"""Token log-probs: fp32 ``log_softmax(logits / T)`` over the full vocabulary, at given tokens.

Math, per row: z = fp32(logits) / T;  m = max(z);  lse = m + log(sum(exp(z - m)));
lp = z[token] - lse. Invariance: row i depends only on row i. The max and the sum run over
fixed VBLOCK-wide chunks in vocabulary order (within a chunk Triton's fixed reduction tree),
never keyed on the number of rows. Vocab-parallel shards combine with ``combine_shards`` in
rank order: m = max over shards, lse = m + log(sum_r exp(lse_r - m)).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

VBLOCK = 4096  # fixed chunk of the vocabulary (no autotune; independent of the row count)


def token_logprobs_reference(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    z = logits.float() / temperature
    return torch.log_softmax(z, dim=-1).gather(-1, tokens.long()[:, None])[:, 0]


@triton.jit
def _logprobs_kernel(L, TOK, OUT, stride_l, V, T, VBLOCK: tl.constexpr):
    row = tl.program_id(0)
    m = tl.full([VBLOCK], float("-inf"), tl.float32)
    for start in range(0, V, VBLOCK):
        cols = start + tl.arange(0, VBLOCK)
        z = tl.load(L + row * stride_l + cols, mask=cols < V, other=float("-inf")).to(tl.float32) / T
        m = tl.maximum(m, z)
    mx = tl.max(m, axis=0)
    acc = tl.zeros([VBLOCK], dtype=tl.float32)
    for start in range(0, V, VBLOCK):
        cols = start + tl.arange(0, VBLOCK)
        z = tl.load(L + row * stride_l + cols, mask=cols < V, other=float("-inf")).to(tl.float32) / T
        acc += tl.exp(z - mx)
    lse = mx + tl.log(tl.sum(acc, axis=0))
    tok = tl.load(TOK + row)
    zt = tl.load(L + row * stride_l + tok).to(tl.float32) / T
    tl.store(OUT + row, zt - lse)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Launcher: logits [rows, V] (any float dtype, unit last stride), tokens [rows] -> fp32 [rows]."""
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"token_logprobs: logits must be [rows, vocab] with unit last stride, got {tuple(logits.shape)}")
    if tokens.shape != logits.shape[:1]:
        raise ValueError(f"token_logprobs: tokens must be [{logits.shape[0]}], got {tuple(tokens.shape)}")
    if not temperature > 0:
        raise ValueError(f"token_logprobs: temperature must be > 0, got {temperature}")
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= logits.shape[1]):
        raise ValueError("token_logprobs: token id out of the vocabulary")
    out = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    if logits.shape[0]:
        _logprobs_kernel[(logits.shape[0],)](logits, tokens.to(torch.int64).contiguous(), out, logits.stride(0),
                                             logits.shape[1], float(temperature), VBLOCK=VBLOCK)
    return out
