"""Truncation by selection: ``kernels.sampling.truncate``'s result, bit for bit, without sorting the row.

The rule (``kernels/sampling.py``): order the vocabulary by logp descending, ties to the lower id;
m_v = floor(exp(fp64 logp_v) * 2^62) (int64); keep the first ``kept`` tokens of that order,
kept = max(1, min(top_k, L_p, L_m)), L_p = #{positions j: before_j <= cut} (V when top_p >= 1),
before_j the exclusive cumsum of m in that order, cut = int64(fp32(top_p) * 2^62),
L_m = #{v: exp(fp64 logp_v) >= fp32(min_p) * exp(fp64 max logp)}; S = sum of m over the kept
tokens; logq_v = fp32(fp64(logp_v) - log(fp64(S) * 2^-62)) when kept, -inf elsewhere; rows that
need no truncation (``truncation_params``) return logp.

Selection instead of a sort. key_v = the fp32 bits of logp_v made monotone as an integer (x >= 0:
bits; x < 0: -(bits & 0x7fffffff); -0.0 and +0.0 share key 0, as the sort ties them). For an
integer t let C(t) = #{key > t} and G(t) = sum of m over key > t: exact integer sums, so neither
the order nor the blocking of the summation can change them. The token at position C(t) (the
first with key <= t) has before = G(t), and ``before`` is nondecreasing, hence

    C(t) < kept  <=>  C(t) == 0  or  (C(t) < top_k  and  C(t) < L_m  and  (top_p >= 1 or G(t) <= cut))

for every t in [min key, max key]. The right side is monotone in t, so a bisection over the
integer t finds t* = the smallest t with C(t) < kept, which is the key of the last kept token.
With C = C(t*), G = G(t*), c = #{key == t*} and m* the (common) mass of those tied tokens, the
tied tokens in order of id have before = G + i * m*, so top_p keeps min(c, (cut - G) // m* + 1) of
them (c when m* = 0, none when G > cut), and kept = max(1, min(top_k, C + that, L_m, C + c)).
The kept set is {key > t*} plus the kept - C lowest ids with key == t*, and S = G + (kept - C) m*.
Every quantity is an exact integer or one IEEE operation on the same operands as ``truncate``'s,
so the bits are the same; ``truncate_select_reference`` (torch, binary bisection) and
``_truncate_select_kernel`` (Triton, WAYS-ary search) state it twice. Precondition (as for
``truncate``): logp holds no NaN or +inf and sum exp(logp) < 2 (the masses' sums fit in int64).

``kernels.sampling.truncate`` runs this kernel on CUDA tensors while ``SELECT_ON_CUDA`` is on
(``select_truncation``), the sort otherwise; the rollout's ``sample`` and the trainer's
``truncated_token_logprobs`` both call ``truncate`` while the switch is on (their cut forms defer to
it), so they take the same path in one process, and the same bits on every path.

Invariance: row r's output depends only on row r's logp and (top_k, top_p, min_p). The kernel
runs one program per row, reads the row in BLOCK-wide chunks, and reduces only by exact integer
sums, max and min; the search's result is unique, so neither BLOCK nor WAYS nor the row count
moves a bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from true_on_policy.kernels.sampling import MASS_BITS, truncation_params

# Launch shape. None of these changes a bit: every reduction over the row is an exact integer
# sum, a min or a max (order- and grouping-free), and the search's answer t* is unique, so the
# chunk width, the number of thresholds tried per pass and the warps only change the speed.
BLOCK = 512  # vocabulary chunk per loop step (a power of two; the search tile is BLOCK x WAYS)
WAYS = 16  # thresholds tried per pass over the row (a power of two >= 2; <= ceil(32 / log2 WAYS) passes)
NUM_WARPS = 8


# ---------------------------------------------------------------------------- reference
def keys(logp: torch.Tensor) -> torch.Tensor:
    """int64 [rows, vocab]: the fp32 bit pattern as an integer that orders like the value."""
    bits = logp.float().contiguous().view(torch.int32).to(torch.int64)
    return torch.where(bits < 0, -(bits & 0x7FFFFFFF), bits)


def truncate_select_reference(logp: torch.Tensor, top_k=None, top_p=None, min_p=None) -> torch.Tensor:
    """``truncate``'s fp32 [rows, vocab] logq by bisection over the keys (module docstring); no sort."""
    rows, vocab = logp.shape
    k, p, mp, need = truncation_params(rows, vocab, logp.device, top_k, top_p, min_p)
    key = keys(logp)
    prob = logp.double().exp()
    mass = (prob * 2.0 ** MASS_BITS).to(torch.int64)
    cut = (p * 2.0 ** MASS_BITS).to(torch.int64)
    usep = p < 1.0
    len_m = (prob >= (mp * logp.max(dim=1).values.double().exp())[:, None]).sum(dim=1)

    def above(t):
        gt = key > t[:, None]
        return gt.sum(dim=1), (mass * gt).sum(dim=1)

    lo, hi = key.min(dim=1).values, key.max(dim=1).values
    while bool((lo < hi).any()):
        mid = lo + (hi - lo) // 2
        C, G = above(mid)
        ok = (C == 0) | ((C < k) & (C < len_m) & (~usep | (G <= cut)))
        hi, lo = torch.where(ok, mid, hi), torch.where(ok, lo, mid + 1)
    C, G = above(hi)
    tie = key == hi[:, None]
    c = tie.sum(dim=1)
    m = torch.where(tie, mass, 0).max(dim=1).values
    fits = torch.where(m > 0, (cut - G).clamp(min=0) // m.clamp(min=1) + 1, c).minimum(c)
    allow = torch.where(usep, torch.where(G > cut, 0, fits), c)
    kept = torch.minimum(torch.minimum(k, C + allow), torch.minimum(len_m, C + c)).clamp(min=1)
    n = kept - C
    rank = torch.cumsum(tie.to(torch.int64), dim=1) - tie.to(torch.int64)  # tied tokens with lower ids
    keep = (key > hi[:, None]) | (tie & (rank < n[:, None]))
    total = (G + n * m).double() * 2.0 ** -MASS_BITS
    logq = torch.where(keep, (logp.double() - torch.log(total)[:, None]).float(), float("-inf"))
    return torch.where(need[:, None], logq, logp)


# ---------------------------------------------------------------------------- kernel
@triton.jit
def _load_keys(LOGP, row_off, cols, VOCAB):
    ok = cols < VOCAB
    x = tl.load(LOGP + row_off + cols, mask=ok, other=float("-inf"))
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, -(bits & 0x7FFFFFFF), bits).to(tl.int64)
    return x, tl.where(ok, key, -2147483648), ok  # masked lanes: below every real key (-inf's)


@triton.jit
def _mass(x):
    return (tl.exp(x.to(tl.float64)) * 4611686018427387904.0).to(tl.int64)  # floor(p * 2^62), p >= 0


@triton.jit
def _truncate_select_kernel(LOGP, OUT, K, CUT, USEP, MP, NEED, stride_in, stride_out, VOCAB,
                            BLOCK: tl.constexpr, WAYS: tl.constexpr):
    """One row: logq (or logp when the row needs no truncation). Passes over the row in BLOCK
    chunks: min/max key; L_m (when min_p > 0); at most ceil(32 / log2 WAYS) search passes, each
    giving C and G at WAYS - 1 thresholds at once (G only when top_p < 1); the tie statistics at
    t*; the output. All reductions are exact (int64 sums and counts, min, max; the tie rank an
    int64 prefix count in id order), so BLOCK and WAYS change no bit. The fp64 exp and log must
    give torch's bits on the same device (CUDA: libdevice, the CUDA math library torch's fp64
    exp / log also use); the GPU tier asserts the result."""
    row = tl.program_id(0).to(tl.int64)
    src = row * stride_in
    dst = row * stride_out
    lanes = tl.arange(0, BLOCK)
    if tl.load(NEED + row) == 0:
        for start in range(0, VOCAB, BLOCK):
            cols = start + lanes
            ok = cols < VOCAB
            tl.store(OUT + dst + cols, tl.load(LOGP + src + cols, mask=ok), mask=ok)
    else:
        k = tl.load(K + row)
        cut = tl.load(CUT + row)
        usep = tl.load(USEP + row)  # 1: top_p < 1 (the cut applies)
        mp = tl.load(MP + row)
        lo = tl.full([], 2147483647, tl.int64)
        hi = tl.full([], -2147483648, tl.int64)
        for start in range(0, VOCAB, BLOCK):
            x, key, ok = _load_keys(LOGP, src, start + lanes, VOCAB)
            lo = tl.minimum(lo, tl.min(tl.where(ok, key, 2147483647), axis=0))
            hi = tl.maximum(hi, tl.max(key, axis=0))
        len_m = tl.full([], 0, tl.int64) + VOCAB
        if mp > 0:  # else every exp(logp) >= min_p * p_max: L_m = V
            top_bits = tl.where(hi < 0, (-hi) | 0x80000000, hi).to(tl.int32)
            thr = mp * tl.exp(top_bits.to(tl.float32, bitcast=True).to(tl.float64))  # min_p * p_max
            len_m = tl.full([], 0, tl.int64)
            for start in range(0, VOCAB, BLOCK):
                x, key, ok = _load_keys(LOGP, src, start + lanes, VOCAB)
                len_m += tl.sum((ok & (tl.exp(x.to(tl.float64)) >= thr)).to(tl.int64), axis=0)
        # search for t*: lane j tries lo + (hi - lo) * (j + 1) // WAYS (lane WAYS - 1 is hi, known true)
        ways = tl.arange(0, WAYS).to(tl.int64)
        while lo < hi:
            cand = lo + (hi - lo) * (ways + 1) // WAYS
            C = tl.zeros([WAYS], tl.int64)
            G = tl.zeros([WAYS], tl.int64)
            for start in range(0, VOCAB, BLOCK):
                x, key, ok = _load_keys(LOGP, src, start + lanes, VOCAB)
                gt = key[:, None] > cand[None, :]
                C += tl.sum(gt.to(tl.int64), axis=0)
                if usep != 0:
                    G += tl.sum(tl.where(gt, _mass(x)[:, None], 0), axis=0)
            ok_t = (C == 0) | ((C < k) & (C < len_m) & ((usep == 0) | (G <= cut)))
            s = tl.min(tl.where(ok_t, ways, WAYS - 1), axis=0)
            new_hi = tl.sum(tl.where(ways == s, cand, 0), axis=0)
            below = tl.sum(tl.where(ways == s - 1, cand, 0), axis=0) + 1
            lo = tl.where(s == 0, lo, below)
            hi = new_hi
        C = tl.full([], 0, tl.int64)
        G = tl.full([], 0, tl.int64)
        c = tl.full([], 0, tl.int64)
        m = tl.full([], 0, tl.int64)
        for start in range(0, VOCAB, BLOCK):
            x, key, ok = _load_keys(LOGP, src, start + lanes, VOCAB)
            mass = _mass(x)
            C += tl.sum((key > hi).to(tl.int64), axis=0)
            G += tl.sum(tl.where(key > hi, mass, 0), axis=0)
            c += tl.sum((key == hi).to(tl.int64), axis=0)
            m = tl.maximum(m, tl.max(tl.where(key == hi, mass, 0), axis=0))
        fits = tl.minimum(tl.where(m > 0, tl.maximum(cut - G, 0) // tl.maximum(m, 1) + 1, c), c)
        allow = tl.where(usep != 0, tl.where(G > cut, 0, fits), c)
        kept = tl.maximum(tl.minimum(tl.minimum(k, C + allow), tl.minimum(len_m, C + c)), 1)
        n = kept - C
        log_total = tl.log((G + n * m).to(tl.float64) * (1.0 / 4611686018427387904.0))  # 2^-62 (folded at compile time), exact
        seen = tl.full([], 0, tl.int64)  # tied tokens in earlier chunks
        for start in range(0, VOCAB, BLOCK):
            cols = start + lanes
            x, key, ok = _load_keys(LOGP, src, cols, VOCAB)
            tie = (key == hi).to(tl.int64)
            rank = seen + tl.cumsum(tie, axis=0) - tie
            keep = (key > hi) | ((tie != 0) & (rank < n))
            q = tl.where(keep, (x.to(tl.float64) - log_total).to(tl.float32), float("-inf"))
            tl.store(OUT + dst + cols, q, mask=ok)
            seen += tl.sum(tie, axis=0)


# ---------------------------------------------------------------------------- launcher
def truncate_select(logp: torch.Tensor, top_k=None, top_p=None, min_p=None, block: int = BLOCK,
                    ways: int = WAYS, num_warps: int = NUM_WARPS) -> torch.Tensor:
    """fp32 [rows, vocab]: bitwise ``kernels.sampling.truncate(logp, top_k, top_p, min_p)``.
    logp fp32 [rows, vocab] (rows may be strided); top_k / top_p / min_p as ``truncate`` takes them.
    One launch, no host synchronisation (CUDA-graph capturable); block / ways / num_warps: speed only."""
    if logp.dim() != 2 or logp.dtype != torch.float32:
        raise ValueError(f"logp must be fp32 [rows, vocab], got {logp.dtype} {tuple(logp.shape)}")
    if block & (block - 1) or ways & (ways - 1) or ways < 2:
        raise ValueError(f"block and ways must be powers of two (ways >= 2), got {block}, {ways}")
    rows, vocab = logp.shape
    k, p, mp, need = truncation_params(rows, vocab, logp.device, top_k, top_p, min_p)
    if logp.stride(1) != 1:
        logp = logp.contiguous()
    out = torch.empty((rows, vocab), dtype=torch.float32, device=logp.device)
    if rows and vocab:
        cut = (p * 2.0 ** MASS_BITS).to(torch.int64)
        _truncate_select_kernel[(rows,)](
            logp, out, k.contiguous(), cut, (p < 1.0).to(torch.int8), mp.contiguous(),
            need.to(torch.int8), logp.stride(0), out.stride(0), vocab, BLOCK=block, WAYS=ways,
            num_warps=num_warps)
    return out
