"""Token log-probs: fp32 ``log_softmax(logits / T)`` over the full vocabulary, at given tokens;
single-process and vocab-parallel forms with the same bits, for any vocabulary size.

Math, per row: z = fp32(logits) / T. The vocabulary of V tokens is cut into 8 virtual shards of
S = ceil(V/8) columns, shard s = [s*S, min((s+1)*S, V)) (the last ones shorter, or empty when
V <= 7*S; V % 8 == 0 gives the equal shards V/8). Per shard: m_s = max z (fixed VBLOCK chunks in
vocabulary order), e_s = sum exp(z - m_s) (same chunks, fp32); an empty shard is (-inf, 0).
Shards combine in the pairwise tree ((0,1),(2,3)),((4,5),(6,7)) with (m, e) + (m', e') =
(M, e*exp(m - M) + e'*exp(m' - M)), M = max(m, m') (exp taken against 0 when M = -inf, so an
empty shard is an exact no-op). lse = M + log(E); result = z[token] - lse.
Invariance: row i depends only on row i (one program per (row, shard); chunk order fixed; no
dependence on the row count). A vocab-parallel degree t (1, 2, 4, 8) holds 8/t whole shards:
rank r's slice is columns [r*W, (r+1)*W), W = (8/t)*S, of the vocabulary padded to 8*S columns
(no padding when V % 8 == 0); padded columns (>= V) are masked, never read into the softmax. Its
shard statistics are all-gathered in fp32 and the same tree is finished, so TP changes nothing.
SGLang never hands the sampler padded columns: ``LogitsProcessor`` all-gathers the vocab-parallel
lm_head output (padded to a multiple of 64, or 64*tp) and slices it to ``vocab_size`` first, so
the rollout runs the single-process form on exactly V columns. The tree runs in
``_finish_kernel`` (elementwise over rows; one launch), used by both forms; ``_tree`` is its
plain-torch statement for the tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from true_on_policy.kernels.limits import KernelLimitError
from true_on_policy.kernels.tree_reduce import gather_stacked, rank_in, sum_exact, world_size

VBLOCK = 4096  # fixed chunk of the vocabulary (no autotune; independent of the row count)
SHARDS = 8  # virtual vocabulary shards (the contract's V; TP degrees dividing it are supported)


def token_logprobs_reference(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0,
                             acc: torch.dtype = torch.float32) -> torch.Tensor:
    z = logits.to(acc) / temperature
    return torch.log_softmax(z, dim=-1).gather(-1, tokens.long()[:, None])[:, 0].float()


@triton.jit
def _shard_stats_kernel(L, STATS, TEMP, stride_l, SHARD, VALID, n_shards, VBLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    T = tl.load(TEMP + row)
    base = L + row * stride_l + s * SHARD
    n = tl.minimum(tl.maximum(VALID - s * SHARD, 0), SHARD)  # shard s's columns (fewer at the end)
    m = tl.full([VBLOCK], float("-inf"), tl.float32)
    for start in range(0, n, VBLOCK):
        cols = start + tl.arange(0, VBLOCK)
        z = tl.load(base + cols, mask=cols < n, other=float("-inf")).to(tl.float32) / T
        m = tl.maximum(m, z)
    mx = tl.max(m, axis=0)
    mx_use = tl.where(mx == float("-inf"), 0.0, mx)  # an empty shard: (-inf, 0)
    acc = tl.zeros([VBLOCK], dtype=tl.float32)
    for start in range(0, n, VBLOCK):
        cols = start + tl.arange(0, VBLOCK)
        z = tl.load(base + cols, mask=cols < n, other=float("-inf")).to(tl.float32) / T
        acc += tl.exp(z - mx_use)
    tl.store(STATS + (row * n_shards + s) * 2, mx)
    tl.store(STATS + (row * n_shards + s) * 2 + 1, tl.sum(acc, axis=0))


@triton.jit
def _merge_stats(ma, ea, mb, eb):
    mm = tl.maximum(ma, mb)
    mu = tl.where(mm == float("-inf"), 0.0, mm)  # two empty shards stay (-inf, 0)
    return mm, ea * tl.exp(ma - mu) + eb * tl.exp(mb - mu)


@triton.jit(do_not_specialize=["ROWS"])
def _finish_kernel(STATS, ZTOK, OUT, ROWS, HAS_Z: tl.constexpr, BLOCK: tl.constexpr):
    """The fixed shard tree for BLOCK rows at once: ((0,1),(2,3)),((4,5),(6,7)); z = 0 without HAS_Z."""
    r = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = r < ROWS
    base = STATS + r * 16
    m0, e0 = tl.load(base + 0, mask=ok, other=0.0), tl.load(base + 1, mask=ok, other=1.0)
    m1, e1 = tl.load(base + 2, mask=ok, other=0.0), tl.load(base + 3, mask=ok, other=1.0)
    m2, e2 = tl.load(base + 4, mask=ok, other=0.0), tl.load(base + 5, mask=ok, other=1.0)
    m3, e3 = tl.load(base + 6, mask=ok, other=0.0), tl.load(base + 7, mask=ok, other=1.0)
    m4, e4 = tl.load(base + 8, mask=ok, other=0.0), tl.load(base + 9, mask=ok, other=1.0)
    m5, e5 = tl.load(base + 10, mask=ok, other=0.0), tl.load(base + 11, mask=ok, other=1.0)
    m6, e6 = tl.load(base + 12, mask=ok, other=0.0), tl.load(base + 13, mask=ok, other=1.0)
    m7, e7 = tl.load(base + 14, mask=ok, other=0.0), tl.load(base + 15, mask=ok, other=1.0)
    m01, e01 = _merge_stats(m0, e0, m1, e1)
    m23, e23 = _merge_stats(m2, e2, m3, e3)
    m45, e45 = _merge_stats(m4, e4, m5, e5)
    m67, e67 = _merge_stats(m6, e6, m7, e7)
    ma, ea = _merge_stats(m01, e01, m23, e23)
    mb, eb = _merge_stats(m45, e45, m67, e67)
    m, e = _merge_stats(ma, ea, mb, eb)
    if HAS_Z:
        z = tl.load(ZTOK + r, mask=ok, other=0.0)
    else:
        z = tl.zeros([BLOCK], tl.float32)
    tl.store(OUT + r, z - (m + tl.log(e)), mask=ok)


def finish(stats: torch.Tensor, z_tok: torch.Tensor | None) -> torch.Tensor:
    """stats [rows, 8, 2] fp32 (all shards, in vocabulary order), z_tok [rows] fp32 -> log-probs;
    ``z_tok`` None: z = 0 in the kernel (-lse per row, with no zeros tensor allocated)."""
    out = torch.empty(stats.shape[0], dtype=torch.float32, device=stats.device)
    if stats.shape[0]:
        z = out if z_tok is None else z_tok.contiguous()  # never read without HAS_Z
        _finish_kernel[(triton.cdiv(stats.shape[0], 128),)](stats.contiguous(), z, out, stats.shape[0],
                                                             HAS_Z=z_tok is not None, BLOCK=128)
    return out


def _merge(a, b):
    (ma, ea), (mb, eb) = a, b
    mm = torch.maximum(ma, mb)
    mu = torch.where(mm == float("-inf"), 0.0, mm)
    return mm, ea * torch.exp(ma - mu) + eb * torch.exp(mb - mu)


def _tree(stats):
    while len(stats) > 1:
        stats = [_merge(stats[i], stats[i + 1]) for i in range(0, len(stats), 2)]
    return stats[0]


def temperatures(temperature, rows: int, device) -> torch.Tensor:
    """One fp32 temperature per row (a scalar is broadcast: the same fp32 value either way)."""
    if isinstance(temperature, torch.Tensor):
        t = temperature.to(device=device, dtype=torch.float32).reshape(-1)
        return t.expand(rows).contiguous() if t.numel() == 1 else t.contiguous()
    return torch.full((rows,), float(temperature), dtype=torch.float32, device=device)


def token_z(logits: torch.Tensor, tokens: torch.Tensor, temp: torch.Tensor, offset: int = 0) -> torch.Tensor:
    """fp32 ``logits[row, token - offset] / T[row]`` (IEEE division by the per-row temperature
    tensor; 0 where the token is outside this slice). The one place the token's z is formed, for
    both forms and the tests: dividing by a Python float instead would let torch multiply by a
    rounded reciprocal, which is not the same bits."""
    tok = tokens.long() - offset
    mine = (tok >= 0) & (tok < logits.shape[1])
    z = logits.gather(1, tok.clamp(0, logits.shape[1] - 1)[:, None])[:, 0].float() / temp
    return torch.where(mine, z, 0.0)


def shard_size(vocab: int) -> int:
    """Columns per virtual shard: ceil(vocab / 8) (the last shards shorter)."""
    return triton.cdiv(vocab, SHARDS)


def shard_stats(logits: torch.Tensor, temperature, n_shards: int, shard: int | None = None,
                valid: int | None = None) -> torch.Tensor:
    """[rows, n_shards, 2] fp32 (max, sum of exp) of the shards of this logits slice: shard s is
    columns [s*shard, min((s+1)*shard, valid)), empty -> (-inf, 0). Defaults: the whole slice is
    the vocabulary (shard = ceil(width / n_shards), valid = width); columns >= valid are never read."""
    rows, width = logits.shape
    shard = triton.cdiv(width, n_shards) if shard is None else shard
    valid = width if valid is None else valid
    if not (0 <= valid <= width and valid <= n_shards * shard):
        raise KernelLimitError(f"token_logprobs: {valid} valid columns do not fit {n_shards} shards of {shard} "
                               f"in a slice of {width}")
    stats = torch.empty(rows, n_shards, 2, dtype=torch.float32, device=logits.device)
    if rows:
        _shard_stats_kernel[(rows, n_shards)](logits, stats, temperatures(temperature, rows, logits.device),
                                              logits.stride(0), shard, valid, n_shards, VBLOCK=VBLOCK)
    return stats


def _check(logits, tokens, temperature, vocab):
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise KernelLimitError(f"token_logprobs: logits must be [rows, vocab] with unit last stride, got {tuple(logits.shape)}")
    if tokens.shape != logits.shape[:1]:
        raise KernelLimitError(f"token_logprobs: tokens must be [{logits.shape[0]}], got {tuple(tokens.shape)}")
    t = temperature if isinstance(temperature, torch.Tensor) else torch.tensor(float(temperature))
    if not bool(((t > 0) & torch.isfinite(t)).all()):
        raise KernelLimitError(f"token_logprobs: temperature must be finite and > 0, got {temperature}")
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab):
        raise KernelLimitError("token_logprobs: token id out of the vocabulary")


def _layout(width: int, world: int, vocab: int | None) -> tuple[int, int]:
    """(vocabulary size, shard size) of a [rows, width] slice at vocab-parallel degree ``world``."""
    vocab = width * world if vocab is None else int(vocab)
    shard = shard_size(vocab)
    if vocab < 1 or (world == 1 and width < vocab):
        raise KernelLimitError(f"token_logprobs: logits of {width} columns cannot hold a vocabulary of {vocab}")
    if world > 1 and width != (SHARDS // world) * shard:
        raise KernelLimitError(f"token_logprobs: at vocab-parallel degree {world} each rank must hold {SHARDS // world} "
                               f"whole shards of {shard} columns ({SHARDS // world * shard}: the vocabulary of {vocab} "
                               f"padded to {SHARDS * shard} = 8 * ceil({vocab} / 8) and split evenly), got {width}; pad "
                               f"the lm_head to {SHARDS * shard} rows, or all-gather the logits and slice them to {vocab} "
                               "as SGLang does")
    return vocab, shard


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature=1.0, group=None,
                   validate: bool = True, vocab: int | None = None) -> torch.Tensor:
    """logits [rows, width] (this rank's contiguous slice; any float dtype; rows may be
    strided), tokens [rows] (global ids), temperature a float or an fp32 tensor [rows] -> fp32
    [rows], identical for every vocab-parallel degree t.
    ``vocab``: the real vocabulary size when the slices carry padding (default: width * t, none).
    One process: width >= vocab, columns >= vocab ignored. Degree t: width = (8/t) * ceil(vocab/8).
    ``validate=False`` skips the token-range check (it syncs the device; CUDA graphs need that)."""
    world = world_size(group)
    if world not in (1, 2, 4, 8):
        raise KernelLimitError(f"token_logprobs: vocab-parallel degree must divide {SHARDS}, got {world}")
    width = logits.shape[1]
    vocab, shard = _layout(width, world, vocab)
    if validate:
        _check(logits, tokens, temperature, vocab)
    temp = temperatures(temperature, logits.shape[0], logits.device)
    if world > 1:
        offset = rank_in(group) * width
        stats = shard_stats(logits, temp, SHARDS // world, shard, min(max(vocab - offset, 0), width))
        z_tok = sum_exact(token_z(logits, tokens, temp, offset), group)  # one holder
        stats = torch.cat(gather_stacked(stats, group).unbind(0), dim=1)
    else:
        stats = shard_stats(logits, temp, SHARDS, shard, vocab)
        z_tok = token_z(logits, tokens, temp)
    return finish(stats, z_tok)
