"""Sampling: draw each token from, and report it with, the contract's fp32 ``log_softmax(logits / T)``.

Math, per row r with temperature T, seed s (int64), position p (the row's position in its sequence):

- logp_v = z_v - lse, z_v = fp32(logits_v) / T (IEEE division), lse the shard tree of
  ``kernels/logprobs`` (the same (max, sum) statistics ``token_logprobs`` uses), so
  logp_v is bitwise ``token_logprobs(logits, v, T)``.
- Truncation (``top_k`` / ``top_p`` / ``min_p``, SGLang's joint rule, all judged on the full
  distribution; ``truncate``): order the vocabulary by logp descending, ties to the lower id; with
  p_v = exp(fp64 logp_v) and its fixed-point mass m_v = floor(p_v * 2^62) (int64), keep
  rank < top_k, exclusive integer cumsum of m <= floor(fp32(top_p) * 2^62), and
  p_v >= fp32(min_p) * p_max (the kept set is a prefix of that order);
  logq_v = fp32(fp64(logp_v) - log(S)) with S = fp64(sum of m over the kept prefix) * 2^-62,
  -inf elsewhere. Without truncation logq = logp. top_p and min_p are rounded to fp32 first
  because SGLang holds them as fp32 tensors: a trainer given the request's Python float must cut
  at the same threshold. The masses are integers so that every sum is exact: no summation order
  (torch picks a different cumsum algorithm for one row than for several) can move a bit.
- Noise: u_v = (murmur3_32(s, p, v) + 0.5) / 2^32 in fp64 (strictly inside (0, 1); SGLang's
  ``h / (2^32 - 1)`` reaches 1 and gives an infinite Gumbel), g_v = -log(-log(u_v)) in fp64.
- token = argmax_v fp64(logq_v) + g_v (Gumbel-max: P(token = v) = exp(logq_v) / sum_w exp(logq_w),
  the reported distribution up to its fp32 rounding); ties to the lowest id.
- Greedy rows (top_k == 1, SGLang's form of T = 0): token = argmax_v fp32 logits_v (ties to the
  lowest id); reported log-prob logp_token at T (= 1 after SGLang's normalisation), untruncated.
- Reported log-prob: logq_token, the very value the draw used.

Invariance: row r depends only on row r's logits and (T, s, p, top_k, top_p, min_p). The draw
reads the vocabulary (any size V) in the 8 fixed shards of ceil(V/8) columns of ``kernels/logprobs``;
each shard's winner is its exact fp64 maximum and lowest id attaining it (an fp32 estimate of the
noise only skips chunks that cannot hold it: ``GUMBEL_ERR``); shard winners are combined in shard
order; nothing depends on the row count or the chunking. The truncation has three forms of one
rule with the same bits: torch's sort (``torch.sort`` stable, whose result is unique;
``torch.cumsum`` over int64 masses, exact whatever algorithm torch picks); torch's top-k, when the
caller knows on the host that every truncating row keeps at most TOP_WIDTH tokens (``torch.topk``'s
values are the sort's, whatever its tie order; the kept ids are read off by value and id:
``_truncate_top``); and the selection kernel of ``kernels/truncation.py`` (no sort; exact integer
counts and sums). ``truncate`` picks one (``SELECT_ON_CUDA``, ``select_truncation``, its
``bound``). A fourth form serves the rollout's ``sample`` and the trainer's
``truncated_token_logprobs`` where a bound of at most TOP_WIDTH is known (and, for ``sample``, no
distribution is asked for: top log-probs): the top-k rule's cut alone (``_top_cut``: the last kept
value, the last kept id among the values equal to it, the log of the kept mass), from which the draw
kernel forms each logq as it reads the logits and the trainer each token's; no [rows, vocab] logq is
formed. Elsewhere both go through ``truncate``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import triton
import triton.language as tl
from true_on_policy.kernels.logprobs import SHARDS, finish, shard_stats, temperatures, token_z
from true_on_policy.kernels.matmul import INTERPRETED

_U_SCALE = 2.0 ** -32
ROW_CHUNK = 256  # rows truncated at once (bounds the sort's memory; results are row-independent)
# ``truncate`` on CUDA tensors runs the selection kernel (``kernels/truncation.py``) instead of the
# sort. Either gives the same bits (proof: that module's docstring), so the switch is speed only and
# a rollout and a trainer may differ in it; on by default only with the GPU tier's check of the kernel
# on the GPU (test_truncation_select_gpu.py, evidence/gpu-tier-truncselect) at the commit that sets it.
# Changed only through ``select_truncation``.
SELECT_ON_CUDA = False
_SELECT_ANYWHERE = False  # select_truncation(force=True): the kernel on every device (the CPU tier)
# ``_top_cut`` on CUDA tensors computes the rows' cuts from topk's values in one kernel (``_cut_kernel``)
# instead of about fifty small torch ops: the same operations on the same values, so the same bits;
# speed only. On by default: the GPU tier's check of it (test_truncation_top_gpu.py,
# evidence/gpu-tier-truncselect) runs at the commit that sets it. Changed only through ``cut_kernel``.
CUT_KERNEL_ON_CUDA = True
_CUT_KERNEL_ANYWHERE = False  # cut_kernel(force=True): the kernel on every device (the CPU tier)


# ---------------------------------------------------------------------------- references
def murmur3_reference(seed: torch.Tensor, positions: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """MurmurHash3 (x86, 32-bit) of the 16 bytes (seed low, seed high, position, column), h0 = 0:
    int64 [rows, cols] holding uint32 values. Plain torch on int64 (masks keep 32 bits)."""
    m32 = 0xFFFFFFFF

    def rotl(x, r):
        return ((x << r) | (x >> (32 - r))) & m32

    def mix(h, k):
        k = (k * 0xCC9E2D51) & m32
        k = (rotl(k, 15) * 0x1B873593) & m32
        h = rotl(h ^ k, 13)
        return (h * 5 + 0xE6546B64) & m32

    s = seed.to(torch.int64)[:, None]
    h = torch.zeros_like(s)
    h = mix(h, s & m32)
    h = mix(h, (s >> 32) & m32)
    h = mix(h, positions.to(torch.int64)[:, None] & m32)
    h = mix(h, cols.to(torch.int64)[None, :] & m32)
    h = h ^ 16
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & m32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & m32
    return h ^ (h >> 16)


def gumbel_reference(hashes: torch.Tensor) -> torch.Tensor:
    u = (hashes.to(torch.float64) + 0.5) * _U_SCALE
    return -torch.log(-torch.log(u))


def sample_reference(logq: torch.Tensor, logits: torch.Tensor, seeds, positions, greedy) -> torch.Tensor:
    """argmax(fp64(logq) + g) per row (argmax of the fp32 logits on greedy rows); ties to the lowest id."""
    cols = torch.arange(logq.shape[1], device=logq.device)
    score = logq.double() + gumbel_reference(murmur3_reference(seeds, positions, cols))
    score = torch.where(greedy[:, None], logits.double(), score)
    return torch.argmax(score, dim=1)


# ---------------------------------------------------------------------------- kernel
@triton.jit
def _mix(h, k):
    """One murmur3 block on uint32 lanes: products and sums wrap mod 2^32 (murmur3's own
    arithmetic; 32-bit integer ops, where the 64-bit form with masks cost several per multiply)."""
    k = k * 0xCC9E2D51
    k = (k << 15) | (k >> 17)
    k = k * 0x1B873593
    h = h ^ k
    h = (h << 13) | (h >> 19)
    return h * 5 + 0xE6546B64


# The draw's fast path. Every score the argmax compares is the exact fp64 one above; the fp32
# estimate below only decides which chunks need it. |g32(h) - g(h)| <= GUMBEL_ERR for every hash h
# (the error analysis in ``_gumbel32``; the GPU tier measures it on 2^28 hashes, the first and last
# 2^26 and the 2^26 around the series switch among them), so the estimate
# a_v = fl32(x_v + g32_v) is within GUMBEL_ERR + 2^-23 |a_v| of the exact score S_v. Any v with
# S_v = max S therefore has a_v >= A - (2 GUMBEL_ERR + 2^-22 (|A| + |a_v|)) for the running maximum
# A of the estimates; a chunk with no such lane holds no maximal score and is skipped. The result
# (maximum, lowest id attaining it) is the exact fp64 argmax's, bit for bit, whatever the chunking.
GUMBEL_ERR = 2.0 ** -16
DRAW_BLOCK = 1024  # lanes per chunk of the draw (the result does not depend on it)


@triton.jit
def _noise_hash(h0, cols):
    """murmur3 of the column on top of the row's (seed, position) state; fmix32 finaliser."""
    h = _mix(h0, cols.to(tl.uint32))
    h = h ^ 16
    h = h ^ (h >> 16)
    h = h * 0x85EBCA6B
    h = h ^ (h >> 13)
    h = h * 0xC2B2AE35
    return h ^ (h >> 16)


@triton.jit
def _gumbel64(h):
    u = (h.to(tl.float64) + 0.5) * (1.0 / 4294967296.0)  # 2^-32 (folded at compile time), exact
    return -tl.log(-tl.log(u))


@triton.jit
def _gumbel32(h):
    """fp32 estimate of ``_gumbel64(h)``: E = -log(u) from u when 1 - u >= 1/16, else from the
    series of -log(1 - d) in d = 1 - u (computed from 2^32 - 1 - h, exact near u = 1); -log(E).
    Error: u and d carry one fp32 rounding each (relative 2^-24), the series' truncation is below
    d^6 / 7 < 2^-24 relatively, so E is within about 2^-20 relatively (E >= 0.0645 on the log
    branch); -log(E) adds that plus its own rounding, at most 2 ulp of |G| <= 23, i.e. 2^-18. With
    logs good to 2 ulp the total stays under 2^-17 = GUMBEL_ERR / 2, what the GPU tier asserts
    (measured: 1.05e-6, about 2^-20)."""
    u = (h.to(tl.float32) + 0.5) * (1.0 / 4294967296.0)  # 2^-32
    d = ((0xFFFFFFFF - h).to(tl.float32) + 0.5) * (1.0 / 4294967296.0)
    series = d * (1.0 + d * (0.5 + d * (0.3333333432674408 + d * (0.25 + d * (0.20000000298023224
                                                                               + d * 0.1666666716337204)))))
    e = tl.where(d < 0.0625, series, -tl.log(u))
    return -tl.log(e)


@triton.jit
def _gumbel_argmax_kernel(VALS, LOGITS, TEMP, LSE, SEED, POS, GREEDY, BEST, BEST_IDX, NEED, EDGE, EDGE_ID, LOG_TOTAL,
                          stride_v, stride_l, SHARD, VOCAB, ERR, FROM_LOGITS: tl.constexpr, TRUNC: tl.constexpr,
                          ANY_GREEDY: tl.constexpr, BLOCK: tl.constexpr):
    """One (row, shard): the shard's best fp64 score and the lowest id attaining it ((-inf, 0) when
    no score beats -inf). Scores: fp64(x) + g, x = logq (``VALS``) or, with FROM_LOGITS,
    logp = logits / T - lse computed here; greedy rows: fp32 logits. With TRUNC (and FROM_LOGITS)
    rows whose NEED is set draw from logq formed here by ``_truncate_top``'s rule from the row's cut
    (``_top_cut``): kept are logp > EDGE and logp == EDGE at ids <= EDGE_ID, each
    fp32(fp64(logp) - LOG_TOTAL), the rest -inf. The fp64 scores are computed only in chunks the
    fp32 estimate cannot rule out (see GUMBEL_ERR). Without ANY_GREEDY no row is greedy and GREEDY
    is not read."""
    row = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    seed = tl.load(SEED + row)
    pos = (tl.load(POS + row) & 0xFFFFFFFF).to(tl.uint32)
    if ANY_GREEDY:
        greedy = tl.load(GREEDY + row) != 0
    else:
        greedy = tl.full([], False, tl.int1)
    h0 = _mix(tl.zeros([BLOCK], tl.uint32), (seed & 0xFFFFFFFF).to(tl.uint32))
    h0 = _mix(h0, ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32))
    h0 = _mix(h0, pos)
    T = tl.load(TEMP + row)
    lse = tl.load(LSE + row)
    if TRUNC:
        need = tl.load(NEED + row) != 0
        edge = tl.load(EDGE + row)
        edge_id = tl.load(EDGE_ID + row)
        log_total = tl.load(LOG_TOTAL + row)
    est_max = tl.full([], float("-inf"), tl.float32)
    best = tl.full([], float("-inf"), tl.float64)
    best_i = tl.full([], 0, tl.int64)
    for start in range(0, SHARD, BLOCK):
        local = start + tl.arange(0, BLOCK)
        cols = s * SHARD + local
        ok = (local < SHARD) & (cols < VOCAB)
        logit = tl.load(LOGITS + row * stride_l + cols, mask=ok, other=float("-inf")).to(tl.float32)
        if FROM_LOGITS:
            x = tl.math.div_rn(logit, T) - lse
            if TRUNC:
                keep = (x > edge) | ((x == edge) & (cols.to(tl.int64) <= edge_id))
                q = tl.where(keep, (x.to(tl.float64) - log_total).to(tl.float32), float("-inf"))
                x = tl.where(need, q, x)
        else:
            x = tl.load(VALS + row * stride_v + cols, mask=ok, other=float("-inf"))
        h = _noise_hash(h0, cols)
        est = tl.where(greedy, logit, x + _gumbel32(h))
        est = tl.where(ok, est, float("-inf"))
        est_max = tl.maximum(est_max, tl.max(est, axis=0))
        slack = 2.0 * ERR + (1.0 / 4194304.0) * (tl.abs(est_max) + tl.abs(est))  # 2^-22
        near = (est > float("-inf")) & (est >= est_max - slack)  # est = -inf exactly when S = -inf
        if tl.max(near.to(tl.int32), axis=0) > 0:
            score = tl.where(greedy, logit.to(tl.float64), x.to(tl.float64) + _gumbel64(h))
            score = tl.where(ok, score, float("-inf"))
            m = tl.max(score, axis=0)
            if m > best:  # strict: an earlier chunk keeps a tie
                best = m
                best_i = tl.min(tl.where(score == m, cols.to(tl.int64), 9223372036854775807), axis=0)
    tl.store(BEST + row * 8 + s, best)
    tl.store(BEST_IDX + row * 8 + s, best_i)


@triton.jit
def _gumbel_error_kernel(OUT, START, COUNT, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """Max |_gumbel32(h) - _gumbel64(h)| over h in [START + pid * BLOCK * ITERS, ...) (GPU tier)."""
    base = START + tl.program_id(0).to(tl.int64) * BLOCK * ITERS
    err = tl.zeros([BLOCK], tl.float64)
    for i in range(ITERS):
        n = base + i * BLOCK + tl.arange(0, BLOCK)
        h = (n & 0xFFFFFFFF).to(tl.uint32)
        d = tl.abs(_gumbel32(h).to(tl.float64) - _gumbel64(h))
        err = tl.maximum(err, tl.where(n < START + COUNT, d, 0.0))
    tl.store(OUT + tl.program_id(0), tl.max(err, axis=0))


def gumbel_error(start: int, count: int, device="cuda") -> float:
    """Largest |fp32 estimate - fp64 noise| over the hashes [start, start + count) (mod 2^32)."""
    block, iters = 1024, 64
    progs = triton.cdiv(count, block * iters)
    out = torch.empty(progs, dtype=torch.float64, device=device)
    _gumbel_error_kernel[(progs,)](out, start, count, BLOCK=block, ITERS=iters)
    return float(out.max())


# ---------------------------------------------------------------------------- launchers
def row_lse(stats: torch.Tensor) -> torch.Tensor:
    """fp32 [rows]: the shard tree's m + log(e), exactly as ``token_logprobs`` subtracts it."""
    return -finish(stats, None)


def log_softmax_rows(logits: torch.Tensor, temperature) -> torch.Tensor:
    """fp32 [rows, vocab]: every entry bitwise ``token_logprobs(logits, v, T)``."""
    temp = temperatures(temperature, logits.shape[0], logits.device)
    lse = row_lse(shard_stats(logits, temp, SHARDS))
    return logits.float() / temp[:, None] - lse[:, None]


def _per_row(value, rows, device, dtype, default):
    if value is None:
        return torch.full((rows,), default, dtype=dtype, device=device)
    t = value.to(device=device, dtype=dtype).reshape(-1) if isinstance(value, torch.Tensor) else \
        torch.full((rows,), value, dtype=dtype, device=device)
    return t.expand(rows).contiguous() if t.numel() == 1 else t


def truncation_params(rows, vocab, device, top_k=None, top_p=None, min_p=None):
    """Per-row (top_k int64, top_p fp64, min_p fp64, need bool); top_p and min_p are the fp64
    widening of their fp32 rounding. top_k <= 0 or >= vocab: all; top_k == 1 is greedy and never
    truncates the reported log-prob."""
    k = _per_row(top_k, rows, device, torch.int64, vocab)
    k = torch.where((k <= 0) | (k > vocab), vocab, k)
    # fp32 first: SGLang's batch holds top_p / min_p as fp32, a trainer passes Python floats
    p = _per_row(top_p, rows, device, torch.float32, 1.0).double()
    mp = _per_row(min_p, rows, device, torch.float32, 0.0).double()
    need = ((k < vocab) | (p < 1.0) | (mp > 0.0)) & (k != 1)
    return k, p, mp, need


@contextlib.contextmanager
def select_truncation(on: bool = True, force: bool = False) -> Iterator[bool]:
    """``with select_truncation(on):`` -- inside the block ``truncate`` takes the selection kernel
    on CUDA tensors (on) or the sort everywhere (off); ``force=True`` (with on) takes the kernel on
    every device, CPU tensors included (they need TRITON_INTERPRET=1: the CPU tier's hook). The
    previous setting is back on exit, however the block ends; blocks nest. The bits do not depend
    on the setting (``kernels/truncation.py``)."""
    global SELECT_ON_CUDA, _SELECT_ANYWHERE
    before = SELECT_ON_CUDA, _SELECT_ANYWHERE
    SELECT_ON_CUDA, _SELECT_ANYWHERE = bool(on), bool(on and force)
    try:
        yield bool(on)
    finally:
        SELECT_ON_CUDA, _SELECT_ANYWHERE = before


@contextlib.contextmanager
def cut_kernel(on: bool = True, force: bool = False) -> Iterator[bool]:
    """``with cut_kernel(on):`` -- inside the block ``_top_cut`` computes the cuts in ``_cut_kernel`` on
    CUDA tensors (on) or in torch ops everywhere (off); ``force=True`` (with on) runs the kernel on
    every device (CPU tensors need TRITON_INTERPRET=1). The previous setting is back on exit; the
    bits do not depend on the setting."""
    global CUT_KERNEL_ON_CUDA, _CUT_KERNEL_ANYWHERE
    before = CUT_KERNEL_ON_CUDA, _CUT_KERNEL_ANYWHERE
    CUT_KERNEL_ON_CUDA, _CUT_KERNEL_ANYWHERE = bool(on), bool(on and force)
    try:
        yield bool(on)
    finally:
        CUT_KERNEL_ON_CUDA, _CUT_KERNEL_ANYWHERE = before


def cuts_in_kernel(logits: torch.Tensor) -> bool:
    """Whether ``_top_cut`` runs ``_cut_kernel`` now (``cut_kernel``)."""
    return _CUT_KERNEL_ANYWHERE or (CUT_KERNEL_ON_CUDA and logits.is_cuda and not INTERPRETED)


def selects(logp: torch.Tensor) -> bool:
    """Whether ``truncate(logp, ...)`` runs the selection kernel now: the switch is on and ``logp``
    is a CUDA tensor outside the interpreter, or the switch is forced."""
    return _SELECT_ANYWHERE or (SELECT_ON_CUDA and logp.is_cuda and not INTERPRETED)


def top_k_bound(top_k, vocab: int) -> int | None:
    """The host-known bound on every row's top_k that ``truncate`` infers: a Python int top_k in
    [1, vocab) (every row the same), else None (rows may keep up to the whole vocabulary)."""
    return top_k if isinstance(top_k, int) and not isinstance(top_k, bool) and 1 <= top_k < vocab else None


def truncate(logp: torch.Tensor, top_k=None, top_p=None, min_p=None, chunk: int = ROW_CHUNK,
             bound: int | None = None) -> torch.Tensor:
    """fp32 [rows, vocab] logq (see the module docstring); rows that need no truncation are logp
    (a copy). ``logp`` holds log-probabilities: no NaN or +inf, and each row's probabilities sum to
    at most 2, so the int64 masses cannot overflow (unchecked: a check would wait on the GPU).
    ``bound``: an int the caller knows on the host, at least the top_k of every row that truncates
    (None: ``top_k_bound``'s, from a scalar top_k). Three forms of the rule, the same bits: the
    selection kernel (``selects``), every row in one launch; up to TOP_WIDTH, ``torch.topk`` of
    ``bound`` values instead of the sort (``_truncate_top``); else the sort. The sort and topk paths
    take rows ``chunk`` at a time (row-independent, so the chunk changes no bit). No path reads a
    value back to the host or sizes an allocation by data (the sort's and topk's own workspaces are
    torch's), so a call can be captured in a CUDA graph when top_k / top_p / min_p are scalars or
    tensors on ``logp``'s device."""
    rows, vocab = logp.shape
    if selects(logp):
        from true_on_policy.kernels.truncation import truncate_select  # (it imports this module)

        return truncate_select(logp, top_k, top_p, min_p)
    if rows == 0:
        return logp.clone()
    width = top_k_bound(top_k, vocab) if bound is None else min(max(int(bound), 1), vocab)
    k, p, mp, need = truncation_params(rows, vocab, logp.device, top_k, top_p, min_p)
    if width is not None and width <= TOP_WIDTH:
        def part(sl):
            return _truncate_top(logp[sl], k[sl], p[sl], mp[sl], need[sl], width)
    else:
        def part(sl):
            return _truncate_rows(logp[sl], k[sl], p[sl], mp[sl], need[sl])
    out = [part(slice(i, i + chunk)) for i in range(0, rows, chunk)]
    return torch.cat(out) if len(out) != 1 else out[0]


MASS_BITS = 62  # fixed-point probability masses: p * 2^62 < 2^63, and V such sums of p <= 1 stay below 2^63
TOP_WIDTH = 1024  # the widest top_k bound ``truncate`` serves with torch.topk (its one-pass radix selection) over the sort


def _cut(srt, k, p, mp, vocab):
    """(kept [rows], total [rows, 1]) of the rule from the first values of each row's order ``srt``
    (descending): the kept prefix's length and fp64 mass. Each criterion keeps a prefix, so a row
    whose top_k is at most ``srt``'s width gets the whole vocabulary's answer from ``srt`` alone."""
    prob = srt.double().exp()
    mass = (prob * 2.0 ** MASS_BITS).to(torch.int64)  # floor (p >= 0); exact sums in any order
    cum = torch.cumsum(mass, dim=-1)
    before = cum - mass  # exclusive, monotone
    cut = (p * 2.0 ** MASS_BITS).to(torch.int64)  # fp32 top_p * 2^62: an exact integer
    len_p = torch.where(p < 1.0, (before <= cut[:, None]).sum(dim=-1), vocab)
    len_m = (prob >= mp[:, None] * prob[:, :1]).sum(dim=-1)
    kept = torch.minimum(torch.minimum(k, len_p), len_m).clamp_(min=1)
    return kept, cum.gather(1, (kept - 1)[:, None]).double() * 2.0 ** -MASS_BITS


def _edge(srt, k, p, mp, vocab):
    """(edge, room, total), each [rows, 1], of the rule from the first values of each row's order
    ``srt`` (``_cut``): the last kept value, how many of the values equal to it are kept (>= 1: the
    edge itself; the lowest ids first) and the kept fp64 mass."""
    kept, total = _cut(srt, k, p, mp, vocab)
    edge = srt.gather(1, (kept - 1)[:, None])
    return edge, kept[:, None] - (srt > edge).sum(dim=-1, keepdim=True), total


def _truncate_rows(logp, k, p, mp, need):
    vocab = logp.shape[1]
    srt, idx = torch.sort(logp, dim=-1, descending=True, stable=True)
    kept, total = _cut(srt, k, p, mp, vocab)
    keep = torch.arange(vocab, device=logp.device)[None, :] < kept[:, None]
    q_sorted = torch.where(keep, (srt.double() - torch.log(total)).float(), float("-inf"))
    logq = torch.empty_like(logp).scatter_(1, idx, q_sorted)
    return torch.where(need[:, None], logq, logp)


def _truncate_top(logp, k, p, mp, need, width):
    """``_truncate_rows`` where every row that truncates has top_k <= ``width``: the first ``width``
    values of the order are ``torch.topk``'s (ties have equal values, so whichever of them topk
    returns, the values are the sort's), which decide kept and total (``_cut``). Which ids are kept
    is then read off the vocabulary: those above the last kept value, and of those equal to it the
    lowest ids (the stable sort's tie order), as many as the prefix holds. The same bits as the sort."""
    vocab = logp.shape[1]
    srt = torch.topk(logp, width, dim=-1, largest=True, sorted=True).values
    edge, room, total = _edge(srt, k, p, mp, vocab)
    tie = logp == edge
    keep = (logp > edge) | (tie & (torch.cumsum(tie, dim=-1, dtype=torch.int32) <= room))
    logq = torch.where(keep, (logp.double() - torch.log(total)).float(), float("-inf"))
    return torch.where(need[:, None], logq, logp)


@triton.jit
def _scan_edge_id(LOGITS, row, stride_l, T, lse, edge, room, VOCAB, BLOCK: tl.constexpr):
    """The ROOM-th lowest id v of row ``row`` with logits[v] / T - lse == edge, scanning the vocabulary
    in id order (a running count of the ties and an inclusive scan within each chunk)."""
    seen = tl.full([], 0, tl.int64)
    found = tl.full([], 9223372036854775807, tl.int64)
    for start in range(0, VOCAB, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        ok = cols < VOCAB
        logit = tl.load(LOGITS + row * stride_l + cols, mask=ok, other=float("-inf")).to(tl.float32)
        tie = ok & ((tl.math.div_rn(logit, T) - lse) == edge)
        rank = seen + tl.cumsum(tie.to(tl.int64), axis=0)
        found = tl.minimum(found, tl.min(tl.where(tie & (rank == room), cols.to(tl.int64),
                                                  9223372036854775807), axis=0))
        seen += tl.sum(tie.to(tl.int64), axis=0)
    return found


@triton.jit
def _edge_id_kernel(LOGITS, TEMP, LSE, EDGE, ROOM, COMPLETE, EDGE_ID, stride_l, VOCAB, BLOCK: tl.constexpr):
    """One row whose cut ``_top_cut`` could not place from topk's ids (COMPLETE == 0): EDGE_ID =
    ``_scan_edge_id``'s. Complete rows: nothing."""
    row = tl.program_id(0).to(tl.int64)
    if tl.load(COMPLETE + row) == 0:
        found = _scan_edge_id(LOGITS, row, stride_l, tl.load(TEMP + row), tl.load(LSE + row), tl.load(EDGE + row),
                              tl.load(ROOM + row), VOCAB, BLOCK)
        tl.store(EDGE_ID + row, found)


@triton.jit
def _cut_kernel(VALS, IDX, LOGITS, TEMP, LSE, K, P, MP, NEED, EDGE, EDGE_ID, LOG_TOTAL, stride_l, W, VOCAB,
                WB: tl.constexpr, BLOCK: tl.constexpr):
    """One row of ``_top_cut`` from topk's W values and ids (VALS, IDX: [rows, W], descending): the
    operations of its torch form on the same values (``_cut``, ``_edge``, the tie order, the
    completeness test and ``_scan_edge_id``), in one program. Masses in units of 2^-62 (MASS_BITS)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, WB)
    ok = offs < W
    T = tl.load(TEMP + row)
    lse = tl.load(LSE + row)
    k = tl.load(K + row)
    p = tl.load(P + row)
    mp = tl.load(MP + row)
    vals = tl.load(VALS + row * W + offs, mask=ok, other=float("-inf")).to(tl.float32)
    ids = tl.load(IDX + row * W + offs, mask=ok, other=VOCAB)
    srt = tl.math.div_rn(vals, T) - lse  # log_softmax_rows's form
    prob = tl.exp(srt.to(tl.float64))
    mass = tl.where(ok, (prob * 4611686018427387904.0).to(tl.int64), 0)  # floor(prob * 2^62), prob >= 0
    cum = tl.cumsum(mass, axis=0)
    before = cum - mass
    cut = (p * 4611686018427387904.0).to(tl.int64)
    len_p = tl.where(p < 1.0, tl.sum((ok & (before <= cut)).to(tl.int64), axis=0), VOCAB)
    prob0 = tl.sum(tl.where(offs == 0, prob, 0.0), axis=0)
    len_m = tl.sum((ok & (prob >= mp * prob0)).to(tl.int64), axis=0)
    kept = tl.maximum(tl.minimum(tl.minimum(k, len_p), len_m), 1)
    at = offs == kept - 1
    total = tl.sum(tl.where(at, cum, 0), axis=0).to(tl.float64) * (1.0 / 4611686018427387904.0)  # exact
    edge = tl.max(tl.where(at, srt, float("-inf")), axis=0)
    room = kept - tl.sum((ok & (srt > edge)).to(tl.int64), axis=0)
    ties = tl.sort(tl.where(ok & (srt == edge), ids, VOCAB), dim=0)
    edge_id = tl.sum(tl.where(offs == room - 1, ties, 0), axis=0)
    last = tl.max(tl.where(offs == W - 1, srt, float("-inf")), axis=0)
    complete = (last < edge) | (edge == float("-inf")) | (W == VOCAB) | (tl.load(NEED + row) == 0)
    if not complete:
        edge_id = _scan_edge_id(LOGITS, row, stride_l, T, lse, edge, room, VOCAB, BLOCK)
    tl.store(EDGE + row, edge)
    tl.store(EDGE_ID + row, edge_id)
    tl.store(LOG_TOTAL + row, tl.log(total))


def _top_cut(logits, temp, lse, k, p, mp, need, width):
    """The truncation of ``_truncate_top`` as a cut instead of a [rows, vocab] logq, from ``torch.topk``
    of the logits: (edge fp32, edge_id int64, log_total fp64), each [rows], such that row r keeps
    exactly the ids v with logp_v > edge, or logp_v == edge and v <= edge_id, as
    fp32(fp64(logp_v) - log_total). Every row that truncates (``need``) must have top_k <= ``width``;
    the cut of a row that does not is never used (nor scanned for).

    logp = logits / T - lse is monotone in the logits (IEEE division by T > 0 and subtraction round
    monotonically), so the first ``width`` + 1 values of logp's order are those of the top logits,
    mapped. They decide kept and the mass (``_cut``), the last kept value (edge) and how many of the
    values equal to it are kept (room: the lowest ids first). When a value below the edge is among
    them, every id whose logp equals the edge is among topk's ids, and the room-th lowest of those is
    edge_id; otherwise the ties may reach past topk's width, and ``_edge_id_kernel`` scans the row.
    Nothing is read back to the host."""
    rows, vocab = logits.shape
    w = min(width + 1, vocab)
    vals, idx = torch.topk(logits, w, dim=-1, largest=True, sorted=True)
    if cuts_in_kernel(logits):
        edge = torch.empty(rows, dtype=torch.float32, device=logits.device)
        edge_id = torch.empty(rows, dtype=torch.int64, device=logits.device)
        log_total = torch.empty(rows, dtype=torch.float64, device=logits.device)
        if rows:
            _cut_kernel[(rows,)](vals, idx, logits, temp, lse, k, p, mp, need.to(torch.int8), edge, edge_id,
                                 log_total, logits.stride(0), w, vocab, WB=triton.next_power_of_2(w),
                                 BLOCK=DRAW_BLOCK)
        return edge, edge_id, log_total
    srt = vals.float() / temp[:, None] - lse[:, None]  # log_softmax_rows's form: the same bits
    edge, room, total = _edge(srt, k, p, mp, vocab)
    ties = torch.where(srt == edge, idx, vocab).sort(dim=-1).values
    edge_id = ties.gather(1, room - 1)[:, 0].contiguous()
    # -inf ties: -inf either way; rows that do not truncate: never read
    complete = (srt[:, -1:] < edge) | (edge == float("-inf")) | (w == vocab) | ~need[:, None]
    if rows:
        _edge_id_kernel[(rows,)](logits, temp, lse, edge[:, 0].contiguous(), room[:, 0].contiguous(),
                                 complete[:, 0].to(torch.int8), edge_id, logits.stride(0), vocab, BLOCK=DRAW_BLOCK)
    return edge[:, 0].contiguous(), edge_id, torch.log(total)[:, 0].contiguous()


def sample(logits: torch.Tensor, temperature, seeds: torch.Tensor, positions: torch.Tensor,
           top_k=None, top_p=None, min_p=None, need_dist: bool = False, truncating: bool | None = None,
           bound: int | None = None):
    """Draw one token per row and report its log-prob (see the module docstring).

    logits fp32 [rows, vocab] (full vocabulary; rows may be strided), temperature float or fp32
    [rows], seeds int [rows], positions int [rows], top_k/top_p/min_p None, scalars or [rows].
    Returns (ids int64 [rows], logprobs fp32 [rows], dist) where dist is the fp32 [rows, vocab]
    distribution drawn from (logq) when ``need_dist``, or when truncation took a full-row form (no
    ``bound`` of at most TOP_WIDTH, or the selection kernel), else None.
    ``truncating=False`` (the caller knows no row has 1 < top_k < vocab, top_p < 1 or min_p > 0)
    skips the truncation; ``None`` infers it from whether any of top_k/top_p/min_p was given.
    ``bound``: ``truncate``'s (None: from a scalar top_k); with one of at most TOP_WIDTH and no
    ``need_dist`` the draw forms logq from the rows' cuts (``_top_cut``), the same bits.
    """
    rows, vocab = logits.shape
    device = logits.device
    bound = top_k_bound(top_k, vocab) if bound is None else bound
    temp = temperatures(temperature, rows, device)
    stats = shard_stats(logits, temp, SHARDS)
    lse = row_lse(stats)
    if top_k is None and top_p is None and min_p is None:  # nothing truncates, no row is greedy
        k = p = mp = greedy = None
    else:
        k, p, mp, need = truncation_params(rows, vocab, device, top_k, top_p, min_p)
        greedy = (k == 1).to(torch.int8)
    if truncating is None:
        truncating = top_k is not None or top_p is not None or min_p is not None
    dist = cut = None
    if truncating and k is not None and not need_dist and bound is not None and bound <= TOP_WIDTH \
            and not selects(logits):  # the draw forms logq itself from the row's cut: no [rows, vocab] pass
        cut = (need.to(torch.int8), *_top_cut(logits, temp, lse, k, p, mp, need, max(int(bound), 1)))
    elif truncating or need_dist:
        dist = logits.float() / temp[:, None] - lse[:, None]
        if truncating:
            dist = truncate(dist, k, p, mp, bound=bound)
    best = torch.empty(rows, 8, dtype=torch.float64, device=device)
    best_idx = torch.empty(rows, 8, dtype=torch.int64, device=device)
    if rows:
        vals = dist if dist is not None else logits
        _gumbel_argmax_kernel[(rows, SHARDS)](
            vals, logits, temp, lse, seeds.to(device=device, dtype=torch.int64).contiguous(),
            positions.to(device=device, dtype=torch.int64).contiguous(), temp if greedy is None else greedy, best,
            best_idx, *(cut or (temp, temp, best_idx, best)), vals.stride(0), logits.stride(0),
            triton.cdiv(vocab, SHARDS), vocab, GUMBEL_ERR, FROM_LOGITS=dist is None, TRUNC=cut is not None,
            ANY_GREEDY=greedy is not None, BLOCK=DRAW_BLOCK)
    ids = best_idx.gather(1, torch.argmax(best, dim=1, keepdim=True))[:, 0]
    if dist is not None:
        lp = dist.gather(1, ids[:, None])[:, 0]
    else:
        lp = finish(stats, token_z(logits, ids, temp))
    if cut is not None:  # the drawn token's logq, by the kernel's rule
        lp = _cut_logq(lp, ids, *cut)
    return ids, lp, dist


def _cut_logq(lp, ids, need, edge, edge_id, log_total):
    """fp32 logq at ``ids`` from their logp (``lp``) and the rows' cuts (``_top_cut``): the draw
    kernel's rule; rows without ``need`` keep logp."""
    keep = (lp > edge) | ((lp == edge) & (ids <= edge_id))
    return torch.where(need != 0, torch.where(keep, (lp.double() - log_total).float(), float("-inf")), lp)


def truncated_token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature=1.0,
                             top_k=None, top_p=None, min_p=None, bound: int | None = None) -> torch.Tensor:
    """The trainer's side of ``sample``: fp32 logq at ``tokens`` (bitwise the rollout's report, whatever
    either side's ``bound``, ``truncate``'s: None infers it from a scalar top_k). With a bound of at
    most TOP_WIDTH it takes the rows' cuts (``_top_cut``) and each token's logp instead of a
    [rows, vocab] logq, as ``sample`` does: the same bits."""
    rows, vocab = logits.shape
    bound = top_k_bound(top_k, vocab) if bound is None else bound
    temp = temperatures(temperature, rows, logits.device)
    k, p, mp, need = truncation_params(rows, vocab, logits.device, top_k, top_p, min_p)
    cut = bound is not None and bound <= TOP_WIDTH and not selects(logits)
    out = []
    for i in range(0, rows, ROW_CHUNK):
        sl = slice(i, i + ROW_CHUNK)
        tok = tokens[sl].long()
        if cut:
            stats = shard_stats(logits[sl], temp[sl], SHARDS)
            lse = row_lse(stats)
            lp = finish(stats, token_z(logits[sl], tok, temp[sl]))
            edge, edge_id, log_total = _top_cut(logits[sl], temp[sl], lse, k[sl], p[sl], mp[sl], need[sl],
                                                max(int(bound), 1))
            out.append(_cut_logq(lp, tok, need[sl].to(torch.int8), edge, edge_id, log_total))
        else:
            logq = truncate(log_softmax_rows(logits[sl], temp[sl]), k[sl], p[sl], mp[sl], bound=bound)
            out.append(logq.gather(1, tok[:, None])[:, 0])
    return torch.cat(out) if out else torch.empty(0, dtype=torch.float32, device=logits.device)


def truncated_token_logprobs_reference(logits, tokens, temperature=1.0, top_k=None, top_p=None, min_p=None,
                                       acc: torch.dtype = torch.float32):
    z = logits.to(acc) / temperatures(temperature, logits.shape[0], logits.device).to(acc)[:, None]
    logq = truncate(torch.log_softmax(z, dim=-1).float(), top_k, top_p, min_p)
    return logq.gather(1, tokens.long()[:, None])[:, 0]


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic of observed ``counts`` against ``probs`` (cells with expected < 5 pooled)
    and its degrees of freedom."""
    n = float(counts.sum())
    exp = probs.double() * n
    big = exp >= 5
    obs_c = torch.cat([counts.double()[big], counts.double()[~big].sum()[None]])
    exp_c = torch.cat([exp[big], exp[~big].sum()[None]])
    keep = exp_c > 0
    stat = float((((obs_c - exp_c) ** 2)[keep] / exp_c[keep]).sum())
    return stat, int(keep.sum()) - 1


def chi_square_critical(dof: int, z: float = 4.0) -> float:
    """Wilson-Hilferty upper quantile of chi-square(dof) at standard-normal ``z`` (4.0: p ~ 3e-5)."""
    a = 2.0 / (9.0 * dof)
    return dof * (1.0 - a + z * math.sqrt(a)) ** 3
