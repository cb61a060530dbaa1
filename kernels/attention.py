"""Causal GQA attention over K/V read through an index table: one kernel for prefill, chunked
prefill over a cached prefix, and decode.

Math, per query (sequence b, absolute position p, query head h, KV head h // G):
  the keys 0..p are cut into segments of SEG = 128 keys at absolute positions [j*SEG, (j+1)*SEG);
  each segment j runs an online softmax from a fresh state over its blocks of BLOCK_N keys:
      s  = fp32(q . k) * scale, keys after p masked to -inf
      m' = max(m, max(s));  a = exp(m - m');  P = exp(s - m')
      l  = l * a + sum(P);  acc = acc * a + bf16(P) @ v   (fp32 accumulate)
  and the segment states (m_j, l_j, acc_j) are merged in segment order j = 0, 1, ...:
      M' = max(M, m_j);  x = exp(M - M');  y = exp(m_j - M')
      L  = fma(l_j, y, L * x);  ACC = fma(acc_j, y, ACC * x)
  out = bf16(ACC / L)
K/V of sequence b, position j live at row ``kv_index[b, j]`` of ``k_buf``/``v_buf`` [S, Hkv, D]:
SGLang's token-indexed KV pool (``req_to_token`` rows) and a trainer's contiguous tensors
(kv_index = b*L + j) go through the same code.
Tiles: a tile holds TOK = BLOCK_M // G consecutive query tokens of one sequence times the G
query heads of one KV head, row r = (token r // G, head r % G); for a group G that does not
divide BLOCK_M (3, 5, 12, ...) rows r >= TOK * G are masked off (loaded as zeros, never stored).
Any integer G = Hq / Hkv with 1 <= G <= BLOCK_M; head_dim 64 or 128.
Invariance: segments and blocks sit at fixed absolute positions from 0 and every row carries its
own state; a row never sees how many other queries share its tile, nor which: each score and
each P.V element of a row is a dot product of that row's q (or P) with keys (values) alone, the
max/sum/merge steps are per row, and the tile's extent only decides how many key blocks are
visited. Keys after p are an exact no-op for that row (a = 1, P = 0; a wholly masked segment
merges as x = 1, y = 0), so a query computed in a full prefill, after a cached prefix, or as a
single decode step -- next to whichever other tokens share its tile -- gets the same bits. For
groups dividing BLOCK_M no row is masked: the tiles and their order are those of the dividing-only
kernel, bit for bit.
Split-KV: when a launch has too few (sequence, tile, KV head) programs to fill the GPU (decode of
a few sequences), each segment runs in its own program, writes its fp32 state, and a second
kernel merges the states in the same order with the same ``_merge`` -- the same operations on
the same values, so splitting or not is a speed choice that changes no bit.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl
from true_on_policy.kernels.limits import KernelLimitError
from true_on_policy.kernels.matmul import INTERPRETED

BLOCK_M = 64  # rows of a tile: (query token, query head of the group) pairs; fixed
BLOCK_N = 64  # keys per block, at absolute positions; fixed (the contract's 64-key blocks)
SEG = 128  # keys per segment (2 blocks), at absolute positions; fixed (the contract's 128-key segments)
# Speed only: warps and pipeline stages change no bit (benchmarks/kernels.py --attention-sweep checks
# it); stages by kernel form, never by token count: 3 for the decode form, 1 for prefill/extend
NUM_WARPS = 4
NUM_STAGES = {"decode": 3, "extend": 1}
# Candidate launch tiles (``attention(tile=...)``, speed only): the fixed tile, and tiles of 16 or 32
# rows (holding a group, BLOCK_M >= G) in ONE warp, for the decode form, whose tile holds one query
# token's G rows. In one warp every row's dot products, max and sums stay inside that warp (sm_90
# lowers it to mma.sync with the warp owning all rows); with 2-4 warps Triton splits a small tile's
# columns over warps, so a row's sums cross warps, and the GPU tier found such tiles off the fixed
# tile's bits (evidence/gpu-tier-attention-tiles-multiwarp). test_attention_tiles_equal_prefill
# checks every candidate, split or not, over the benchmark geometries' head groups;
# benchmarks/attention_decode.py times them against stock SGLang. 64 rows in one warp keep the bits
# but spill registers: left out.
TILE_BM = (16, 32, 64)
TILE_WARPS = (1, 2, 4, 8)
TILE_STAGES = (1, 2, 3, 4)
ONE_WARP_BM = (16, 32)
ONE_WARP_STAGES = (1, 2, 3)
# Decode tiles chosen once at start-up among the candidates (``choose_decode_tiles``, run before the
# decode CUDA graphs are captured when TRUE_ON_POLICY_DECODE_TILES=choose): for each of the model's
# (Hq, Hkv, D) on this rank, ((largest batch, tile or None for the fixed tile), ...) by batch.
# Every candidate gives the fixed tile's bits, so the choice is speed only.
_DECODE_TILES: dict[tuple[int, int, int], tuple[tuple[int, dict | None], ...]] = {}
CHOICE_MARGIN = 0.03  # a candidate replaces the fixed tile only when this much faster (timing noise)
# The flat loop (a tile's ``loop="flat"``, both forms): the nested loop runs a segment's two blocks as an
# inner loop of two trips, which leaves a software pipeline nothing to fetch ahead across segments; the
# flat loop runs every block of the program's segments in one loop, resetting the segment state at a
# segment's first block and folding (or storing) it at its last: the same blocks, operations and merge order.
# Every candidate comes in both loops; the choice times the forms in ``chooser_tiles``.
# Splits the choice times besides the rule's (``choice_splits``): one-warp tiles leave an SM with few warps
# in flight where the rule stops splitting (two programs per SM), and the rule's own split can leave a
# last round of programs half-empty; a power of two of the segments often balances them better.
CHOICE_SPLITS = (1, 2, 4, 8)
CHOOSER_FORMS = ((2, None), (2, "flat"), (3, "flat"))  # (stages, loop) of the one-warp tiles the choice times
# The prefill form's loop (``set_prefill_loop``; the patches set it from TRUE_ON_POLICY_PREFILL_LOOP): "nested"
# (the default) or "flat", the fixed tile either way. Speed only: both give the same bits.
PREFILL_LOOPS = ("nested", "flat")
_PREFILL_TILE: dict = {}
# The prefill tile chosen once at start-up (``choose_prefill_tile``; the patches run it before the first CUDA-graph
# capture when TRUE_ON_POLICY_PREFILL_LOOP=choose), per (Hq, Hkv, D) on this rank, among
# ``prefill_candidates``: the fixed tile in the prefill's 1 stage and in the decode form's 3, each in both loops.
# Stages change no bit, and on the GPU each of these gives the nested loop's bits in the prefill form
# (test_attention_tiles_equal_prefill, test_attention_prefill_flat_loop_keeps_the_bits): speed only. The
# one-warp tiles are left out: 1.58x stock's extend kernel or slower wherever timed in the prefill form.
_PREFILL_TILES: dict[tuple[int, int, int], dict | None] = {}
PREFILL_CHOICE_SHAPES = ((4, 1024), (1, 4096))  # (sequences, new tokens each) the choice times: a 4,096-token chunk
SPLIT_STATE_BYTES = 512 << 20  # the largest state buffer a split chosen beyond the rule may hold


def attention_reference(q, k_buf, v_buf, kv_index, q_start, q_len, q_pos0, scale=None, acc=torch.float32):
    """Plain torch, one sequence at a time: softmax(q k^T * scale + causal) v in ``acc``
    (fp32 by default), rounded through fp32 to q's dtype."""
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    out = torch.empty_like(q)
    g = q.shape[1] // k_buf.shape[1]
    for b in range(kv_index.shape[0]):
        n, s0, p0 = int(q_len[b]), int(q_start[b]), int(q_pos0[b])
        if n == 0:
            continue
        idx = kv_index[b, : p0 + n].long()
        k = k_buf[idx].to(acc).repeat_interleave(g, dim=1)  # [L, Hq, D]
        v = v_buf[idx].to(acc).repeat_interleave(g, dim=1)
        qb = q[s0:s0 + n].to(acc)
        s = torch.einsum("thd,lhd->htl", qb, k) * scale
        pos = p0 + torch.arange(n, device=q.device)
        s = s.masked_fill(torch.arange(p0 + n, device=q.device)[None, None, :] > pos[None, :, None], float("-inf"))
        out[s0:s0 + n] = torch.einsum("htl,lhd->thd", torch.softmax(s, -1), v).float().to(q.dtype)
    return out


@triton.jit
def _merge(m, l, acc, m_s, l_s, acc_s):
    """Fold one segment's state into the running one. Explicit fma: the same roundings in the
    attention kernel and in the split-KV merge kernel, whatever the compiler would contract."""
    m_new = tl.maximum(m, m_s)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet stay (-inf, 0, 0)
    x = tl.exp(m - m_use)
    y = tl.exp(m_s - m_use)
    return m_new, tl.fma(l_s, y, l * x), tl.fma(acc_s, y[:, None], acc * x[:, None])


@triton.jit
def _rows(b, tile, kvh, Q_START, Q_LEN, Q_POS0, SEQ_LENS, G: tl.constexpr, BLOCK_M: tl.constexpr,
          DECODE: tl.constexpr):
    """The tile's rows: query token, head, position, validity, and the tile's largest position."""
    TOK: tl.constexpr = BLOCK_M // G
    if DECODE:  # one query per sequence, at position seq_lens[b] - 1, in row b of q
        n_q = 1
        q0 = b
        p0 = tl.load(SEQ_LENS + b) - 1
    else:
        n_q = tl.load(Q_LEN + b)
        q0 = tl.load(Q_START + b)
        p0 = tl.load(Q_POS0 + b)
    r = tl.arange(0, BLOCK_M)
    tok = tile * TOK + r // G
    row_ok = tok < n_q
    if TOK * G < BLOCK_M:  # G does not divide BLOCK_M: the last BLOCK_M % G rows hold no query
        row_ok = row_ok & (r < TOK * G)
    head = kvh * G + r % G
    pos = tl.where(row_ok, p0 + tok, p0)  # invalid rows see key 0 only (never stored)
    last = p0 + tl.minimum(n_q, (tile + 1) * TOK) - 1
    return n_q, (q0 + tok).to(tl.int64), head, row_ok, pos, last


@triton.jit
def _block(K, V, q, table, kvh, d, pos, last, start, m, l, acc, scale, stride_kt, stride_kh, stride_vt, stride_vh,
           BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr):
    """One block of BLOCK_N keys from absolute position ``start`` folded into a segment's state (m, l, acc)."""
    kpos = start + tl.arange(0, BLOCK_N)
    k_ok = kpos <= last
    slot = tl.load(table + kpos, mask=k_ok, other=0).to(tl.int64)
    k = tl.load(K + slot[:, None] * stride_kt + kvh * stride_kh + d[None, :], mask=k_ok[:, None], other=0.0)
    v = tl.load(V + slot[:, None] * stride_vt + kvh * stride_vh + d[None, :], mask=k_ok[:, None], other=0.0)
    if DOT_F32:
        s = tl.dot(q.to(tl.float64), tl.trans(k.to(tl.float64))).to(tl.float32)
    else:
        s = tl.dot(q, tl.trans(k))
    s = s * scale
    s = tl.where(kpos[None, :] <= pos[:, None], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row whose keys all lie later
    a = tl.exp(m - m_use)
    p = tl.exp(s - m_use[:, None])
    l = l * a + tl.sum(p, axis=1)
    pv = p.to(v.dtype)
    if DOT_F32:
        acc = acc * a[:, None] + tl.dot(pv.to(tl.float64), v.to(tl.float64)).to(tl.float32)
    else:
        acc = acc * a[:, None] + tl.dot(pv, v)
    return m_new, l, acc


@triton.jit
def _attention_kernel(Q, K, V, O, PART, PART_ML, KV_INDEX, KV_ROWS, Q_START, Q_LEN, Q_POS0, SEQ_LENS, scale,
                      n_split, nseg_max, seg_rows, n_heads, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
                      stride_vh, stride_ot, stride_oh, stride_ib,
                      G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      SEG: tl.constexpr, HAS_ROWS: tl.constexpr, DECODE: tl.constexpr, SPLIT: tl.constexpr,
                      DOT_F32: tl.constexpr, FLAT_LOOP: tl.constexpr = False):
    b = tl.program_id(0)
    tile = tl.program_id(1)
    kvh = tl.program_id(2)
    if SPLIT:  # program (kvh, sp) runs segments sp, sp + n_split, ... and stores their states
        sp = kvh % n_split
        kvh = kvh // n_split
    n_q, q_rows, head, row_ok, pos, last = _rows(b, tile, kvh, Q_START, Q_LEN, Q_POS0, SEQ_LENS, G, BLOCK_M, DECODE)
    if tile * (BLOCK_M // G) >= n_q:
        return
    d = tl.arange(0, D)
    q = tl.load(Q + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :], mask=row_ok[:, None],
                other=0.0)
    table = KV_INDEX + b.to(tl.int64) * stride_ib
    if HAS_ROWS:  # sequence b's table is row kv_rows[b] (SGLang: req_to_token[req_pool_indices[b]])
        table = KV_INDEX + tl.load(KV_ROWS + b).to(tl.int64) * stride_ib
    M = tl.full([BLOCK_M], float("-inf"), tl.float32)
    L = tl.zeros([BLOCK_M], dtype=tl.float32)
    ACC = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    seg_first = 0
    seg_step = 1
    nseg = tl.cdiv(last + 1, SEG)
    if SPLIT:
        seg_first = sp
        seg_step = n_split
        nseg = tl.minimum(nseg, nseg_max)  # never past the state buffer (the merge kernel flags it)
    if FLAT_LOOP:  # the same blocks in one loop over this program's segments x SEG // BLOCK_N blocks
        BPS: tl.constexpr = SEG // BLOCK_N
        n_mine = tl.maximum(tl.cdiv(nseg - seg_first, seg_step), 0)
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
        for t in range(0, n_mine * BPS):
            j = seg_first + (t // BPS) * seg_step
            fresh = t % BPS == 0  # a segment's first block: a fresh state, as the nested loop starts one
            m = tl.where(fresh, float("-inf"), m)
            l = tl.where(fresh, 0.0, l)
            acc = tl.where(fresh, 0.0, acc)
            # a block past ``last`` (a last segment of one block) masks every key: an exact no-op
            m, l, acc = _block(K, V, q, table, kvh, d, pos, last, j * SEG + (t % BPS) * BLOCK_N, m, l, acc, scale,
                               stride_kt, stride_kh, stride_vt, stride_vh, BLOCK_N, DOT_F32)
            end = t % BPS == BPS - 1
            if SPLIT:
                at = j * seg_rows + q_rows * n_heads + head
                tl.store(PART + at[:, None] * D + d[None, :], acc, mask=row_ok[:, None] & end)
                tl.store(PART_ML + 2 * at, m, mask=row_ok & end)
                tl.store(PART_ML + 2 * at + 1, l, mask=row_ok & end)
            else:
                M2, L2, ACC2 = _merge(M, L, ACC, m, l, acc)
                M = tl.where(end, M2, M)
                L = tl.where(end, L2, L)
                ACC = tl.where(end, ACC2, ACC)
    else:
        for j in range(seg_first, nseg, seg_step):
            m = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l = tl.zeros([BLOCK_M], dtype=tl.float32)
            acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
            for start in range(j * SEG, tl.minimum((j + 1) * SEG, last + 1), BLOCK_N):
                m, l, acc = _block(K, V, q, table, kvh, d, pos, last, start, m, l, acc, scale, stride_kt, stride_kh,
                                   stride_vt, stride_vh, BLOCK_N, DOT_F32)
            if SPLIT:  # state of (segment j, query row, head) at row j * seg_rows + q_row * Hq + head
                at = j * seg_rows + q_rows * n_heads + head
                tl.store(PART + at[:, None] * D + d[None, :], acc, mask=row_ok[:, None])
                tl.store(PART_ML + 2 * at, m, mask=row_ok)
                tl.store(PART_ML + 2 * at + 1, l, mask=row_ok)
            else:
                M, L, ACC = _merge(M, L, ACC, m, l, acc)
    if not SPLIT:
        tl.store(O + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 (ACC / L[:, None]).to(O.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _merge_kernel(O, PART, PART_ML, Q_START, Q_LEN, Q_POS0, SEQ_LENS, nseg_max, seg_rows, n_heads, stride_ot,
                  stride_oh, G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, SEG: tl.constexpr,
                  DECODE: tl.constexpr):
    b = tl.program_id(0)
    tile = tl.program_id(1)
    kvh = tl.program_id(2)
    n_q, q_rows, head, row_ok, pos, last = _rows(b, tile, kvh, Q_START, Q_LEN, Q_POS0, SEQ_LENS, G, BLOCK_M, DECODE)
    if tile * (BLOCK_M // G) >= n_q:
        return
    d = tl.arange(0, D)
    M = tl.full([BLOCK_M], float("-inf"), tl.float32)
    L = tl.zeros([BLOCK_M], dtype=tl.float32)
    ACC = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    nseg = tl.cdiv(last + 1, SEG)
    for j in range(0, tl.minimum(nseg, nseg_max)):
        at = j * seg_rows + q_rows * n_heads + head
        acc = tl.load(PART + at[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0)
        m = tl.load(PART_ML + 2 * at, mask=row_ok, other=float("-inf"))
        l = tl.load(PART_ML + 2 * at + 1, mask=row_ok, other=0.0)
        M, L, ACC = _merge(M, L, ACC, m, l, acc)
    out = ACC / L[:, None]
    out = tl.where(nseg > nseg_max, float("nan"), out)  # longer than max_kv_len: loud, never silently short
    tl.store(O + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :], out.to(O.dtype.element_ty),
             mask=row_ok[:, None])


HEAD_DIMS = (64, 128)  # the head dims the tiles are built and tested for (every Qwen3-MoE checkpoint: 128)


def _check_layout(hq: int, hkv: int, d: int) -> None:
    """Refuse a head layout the kernel does not cover, naming what to change."""
    if d not in HEAD_DIMS:
        raise KernelLimitError(f"attention: head_dim {d} is not supported (the contract's attention kernel covers head_dim "
                               f"{' and '.join(map(str, HEAD_DIMS))} only); serve this checkpoint without the true-on-policy "
                               "overlay, or use one with head_dim 64 or 128")
    if hkv < 1 or hq % hkv:
        raise KernelLimitError(f"attention: {hq} query heads cannot be grouped over {hkv} KV heads (Hq must be a "
                               "multiple of Hkv); check num_attention_heads / num_key_value_heads and the TP degree")
    if hq // hkv > BLOCK_M:
        raise KernelLimitError(f"attention: {hq // hkv} query heads per KV head exceed one {BLOCK_M}-row tile; use a TP "
                               f"degree that leaves at most {BLOCK_M} query heads per KV head on a rank")


def candidate_tiles(g: int) -> list[dict]:
    """The candidate launch tiles for head groups of ``g``: the fixed tile (64 rows, 4 warps, 3 stages)
    first, then one-warp tiles of 16 or 32 rows holding a group, in 1, 2 or 3 stages; then each of those
    in the flat loop (``loop="flat"``, a program's blocks in one loop: ``FLAT_LOOP``)."""
    fixed = dict(BLOCK_M=BLOCK_M, num_warps=NUM_WARPS, num_stages=NUM_STAGES["decode"])
    nested = [fixed] + [dict(BLOCK_M=bm, num_warps=1, num_stages=st) for bm in ONE_WARP_BM if bm >= g
                        for st in ONE_WARP_STAGES]
    return nested + [dict(t, loop="flat") for t in nested]


def decode_tile_for(hq: int, hkv: int, d: int, batch: int) -> dict | None:
    """The decode tile chosen at start-up for ``batch`` sequences of this head layout (None: the fixed
    tile; also when nothing was chosen). A batch takes the choice of the smallest timed batch at or
    above it; beyond the largest timed batch, that batch's tile without its split (a chosen split's
    state buffer is bounded at the batch it was timed for), so the split rule applies."""
    sizes = _DECODE_TILES.get((hq, hkv, d))
    if not sizes:
        return None
    if batch > sizes[-1][0]:  # beyond every timed batch: the largest's tile, split by the rule
        unsplit = {k: v for k, v in (sizes[-1][1] or {}).items() if k != "split"}
        return unsplit or None
    return next(tile for top, tile in sizes if batch <= top)


def set_decode_tiles(hq: int, hkv: int, d: int, choice: dict[int, dict | None]) -> None:
    """Install a choice {timed batch: tile or None}; every tile must be a candidate of the layout,
    with or without a ``split`` (a positive int)."""
    g = hq // hkv

    def ok(t):
        split = t.get("split", 1)
        return ({k: v for k, v in t.items() if k != "split"} in candidate_tiles(g) and isinstance(split, int)
                and not isinstance(split, bool) and split >= 1)
    bad = [t for t in choice.values() if t is not None and not ok(t)]
    if bad:
        raise KernelLimitError(f"attention: decode tiles {bad} are not candidates for groups of {g} "
                               f"({candidate_tiles(g)})")
    _DECODE_TILES[(hq, hkv, d)] = tuple(sorted(choice.items()))


def clear_decode_tiles() -> None:
    _DECODE_TILES.clear()


def set_prefill_loop(loop: str) -> None:
    """The loop the prefill form runs without a ``tile``: "nested" or "flat" (``PREFILL_LOOPS``)."""
    if loop not in PREFILL_LOOPS:
        raise KernelLimitError(f"attention: prefill loop {loop!r} is not one of {PREFILL_LOOPS}")
    _PREFILL_TILE.clear()
    if loop == "flat":
        _PREFILL_TILE["loop"] = "flat"


def prefill_loop() -> str:
    """The loop the prefill form runs without a ``tile`` ("nested" or "flat")."""
    return _PREFILL_TILE.get("loop", "nested")


def prefill_candidates() -> list[dict]:
    """The tiles the prefill choice times, as ``attention(tile=...)`` takes them: the prefill's default (the
    fixed tile, 1 stage, nested loop) first, then the fixed tile in the decode form's 3 stages, then each of
    those in the flat loop."""
    nested = [dict(BLOCK_M=BLOCK_M, num_warps=NUM_WARPS, num_stages=NUM_STAGES[form]) for form in ("extend", "decode")]
    return nested + [dict(t, loop="flat") for t in nested]


def set_prefill_tile(hq: int, hkv: int, d: int, tile: dict | None) -> None:
    """Install the prefill tile of a head layout: one of ``prefill_candidates``, or None for the loop
    ``set_prefill_loop`` sets."""
    if tile is not None and tile not in prefill_candidates():
        raise KernelLimitError(f"attention: prefill tile {tile} is not a candidate ({prefill_candidates()})")
    _PREFILL_TILES[(hq, hkv, d)] = None if tile is None else dict(tile)


def prefill_tile_for(hq: int, hkv: int, d: int) -> dict:
    """The launch tile of the prefill form for this head layout without a ``tile`` argument: the one
    ``choose_prefill_tile`` installed, else the fixed tile in the loop of ``set_prefill_loop`` ({} for the
    nested loop)."""
    return _PREFILL_TILES.get((hq, hkv, d)) or _PREFILL_TILE


def clear_prefill_tiles() -> None:
    _PREFILL_TILES.clear()


def pick_tile(times: dict, margin: float = CHOICE_MARGIN):
    """From {tile key: seconds} with the fixed tile under None: the fastest candidate when it beats
    the fixed tile by more than ``margin``, else None."""
    best = min((k for k in times if k is not None), key=times.__getitem__, default=None)
    if best is None or times[best] >= times[None] * (1 - margin):
        return None
    return best


def chooser_tiles(g: int) -> list[dict]:
    """The candidates the start-up choice times besides the fixed tile: the fixed tile in the flat
    loop, and the fewest one-warp rows that hold a group of ``g`` in the forms of ``CHOOSER_FORMS``.
    Neither loop wins everywhere: the flat loop runs the one-warp tile in 3 stages fastest at most
    batches, the nested loop in 2 stages at some; wider one-warp tiles and 1 stage were slower wherever
    timed (docs/throughput.md)."""
    fixed, *rest = candidate_tiles(g)
    cands = [t for t in rest if t["num_warps"] == 1]
    bm = min((t["BLOCK_M"] for t in cands), default=None)
    one_warp = [t for t in cands if t["BLOCK_M"] == bm and (t["num_stages"], t.get("loop")) in CHOOSER_FORMS]
    return [dict(fixed, loop="flat"), *one_warp]


def decode_variants(hq: int, hkv: int, b: int, max_kv_len: int, fill: int, d: int = 128) -> list[dict | None]:
    """What the start-up choice times for ``b`` sequences: the fixed tile as the server launches it
    (None), then the fixed tile and each of ``chooser_tiles`` with the split rule and with each split of
    ``choice_splits``, each a ``tile`` for ``attention``."""
    g = hq // hkv
    fixed = candidate_tiles(g)[0]
    rule = split_rule(b * hkv, triton.cdiv(max_kv_len, SEG), fill)
    splits = [s for s in choice_splits(hq, hkv, b, max_kv_len, fill, d) if s != rule]
    out: list[dict | None] = [None]
    for t in [fixed, *chooser_tiles(g)]:
        out += ([] if t is fixed else [t]) + [dict(t, split=s) for s in splits]
    return out


def split_state_bytes(hq: int, b: int, max_kv_len: int, d: int) -> int:
    """The fp32 state buffer of a split launch of ``b`` query tokens: every segment's (acc, m, l)."""
    return triton.cdiv(max_kv_len, SEG) * b * hq * (d + 2) * 4


def choice_splits(hq: int, hkv: int, b: int, max_kv_len: int, fill: int, d: int = 128) -> list[int]:
    """The splits the start-up choice times for ``b`` sequences, ascending: the split rule's, 2 and 4
    times it, and each of ``CHOICE_SPLITS`` that still gives every SM a program (``fill`` // 2), at most
    the segments of ``max_kv_len``. So a choice timed over a short context never leaves SMs idle on a
    long one. Where the rule does not split, a split's state buffer must stay within
    ``SPLIT_STATE_BYTES`` (the rule's own splits, at fewer programs, keep the bound ``attention`` states)."""
    nseg_max = triton.cdiv(max_kv_len, SEG)
    if nseg_max <= 1:
        return [1]
    rule = split_rule(b * hkv, nseg_max, fill)
    out = {min(m * rule, nseg_max) for m in (1, 2, 4)} if rule > 1 else {1}
    out |= {min(s, nseg_max) for s in CHOICE_SPLITS if b * hkv * s >= fill // 2}
    if rule == 1 and split_state_bytes(hq, b, max_kv_len, d) > SPLIT_STATE_BYTES:
        out = {1}
    return sorted(out)


def tile_label(tile: dict | None) -> str:
    if not tile:
        return "fixed"
    name = f"{tile['BLOCK_M']} rows w{tile['num_warps']} s{tile['num_stages']}"
    return name + (" flat" if tile.get("loop") == "flat" else "") + (f" split {tile['split']}" if "split" in tile else "")


def time_graphs(calls, device, rounds: int, reps: int) -> list[float]:
    """Median ms of one CUDA-graph replay of ``reps`` calls of each of ``calls``, every call compiled and
    warmed on a side stream before its capture, the graphs (one shared pool, as SGLang's share one)
    alternated over ``rounds`` rounds after a warm-up round. Graphs, as the server replays them: timing
    eager calls would time the host's launches, not the kernels, at small sizes."""
    import statistics

    graphs = []
    pool = torch.cuda.graph_pool_handle()  # shared, as SGLang's graphs share one: replayed one at a time
    side = torch.cuda.Stream(device=device)
    side.wait_stream(torch.cuda.current_stream(device))
    for call in calls:
        with torch.cuda.stream(side):  # compile and warm outside the capture
            call()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            for _ in range(reps):
                call()
        graphs.append(graph)
    order = list(range(len(calls)))
    times: list[list[float]] = [[] for _ in order]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for r in range(rounds + 1):  # round 0 warms the graphs
        for i in order[r % len(order):] + order[:r % len(order)]:
            start.record()
            graphs[i].replay()
            end.record()
            end.synchronize()
            if r:
                times[i].append(start.elapsed_time(end))
    del graphs
    return [statistics.median(t) for t in times]


def _time_decode(hq, d, b, tiles, k_buf, v_buf, max_kv_len, context, rounds, reps, gen) -> list[float]:
    """Median ms of one CUDA-graph replay of ``reps`` decode calls per tile of ``tiles`` (None: the
    fixed tile) for ``b`` sequences of ``context`` keys at random rows of the pool (``time_graphs``)."""
    ctx = max(1, min(context, max_kv_len))
    table = torch.randint(0, k_buf.shape[0], (b, ctx), device=k_buf.device, generator=gen, dtype=torch.int32)
    q = torch.randn(b, hq, d, device=k_buf.device, generator=gen).to(k_buf.dtype)
    lens = torch.full((b,), ctx, dtype=torch.int32, device=k_buf.device)
    out = torch.empty_like(q)
    fixed = candidate_tiles(hq // k_buf.shape[1])[0]

    def call(tile):
        return lambda: attention(q, k_buf, v_buf, table, None, None, None, 1, max_kv_len=max_kv_len, seq_lens=lens,
                                 out=out, tile=tile or fixed)
    return time_graphs([call(t) for t in tiles], k_buf.device, rounds, reps)


def _time_prefill(hq, d, b, new, tiles, k_buf, v_buf, max_kv_len, rounds, reps, gen) -> list[float]:
    """Median ms of one CUDA-graph replay of ``reps`` prefill calls per tile of ``tiles``: ``b`` fresh
    sequences of ``new`` tokens each, causal, their keys at random rows of the pool (``time_graphs``)."""
    dev, i32 = k_buf.device, torch.int32
    table = torch.randint(0, k_buf.shape[0], (b, new), device=dev, generator=gen, dtype=i32)
    q = torch.randn(b * new, hq, d, device=dev, generator=gen).to(k_buf.dtype)
    starts = torch.arange(b, device=dev, dtype=i32) * new
    lens = torch.full((b,), new, device=dev, dtype=i32)
    pos0 = torch.zeros(b, device=dev, dtype=i32)
    out = torch.empty_like(q)

    def call(tile):
        return lambda: attention(q, k_buf, v_buf, table, starts, lens, pos0, new, max_kv_len=max_kv_len, out=out,
                                 tile=tile)
    return time_graphs([call(t) for t in tiles], dev, rounds, reps)


def choose_decode_tiles(hq: int, hkv: int, d: int, batches, k_buf, v_buf, max_kv_len: int, context: int = 1024,
                        rounds: int = 3, reps: int = 10, times_out: dict | None = None) -> dict[int, dict | None]:
    """Time ``decode_variants`` (the fixed tile as launched, then candidate tiles and splits) in the
    decode form at each batch of ``batches``, ``context`` keys per sequence at random rows of
    ``k_buf``/``v_buf`` [S, Hkv, D] (the server's KV pool: its memory, not its values, matters) with
    ``max_kv_len`` as the server passes it, alternating them over ``rounds`` rounds; install and
    return {batch: the fastest, None for the fixed tile as launched} (``pick_tile``). Every candidate
    and split gives the fixed tile's bits: this decides speed only. ``times_out`` (optional)
    receives {batch: {``tile_label``: median ms of a graph of ``reps`` calls}}. CUDA only; call it
    outside CUDA-graph capture."""
    _check_layout(hq, hkv, d)
    gen = torch.Generator(device=k_buf.device).manual_seed(0)
    choice: dict[int, dict | None] = {}
    for b in sorted({int(x) for x in batches if int(x) > 0}):
        variants = decode_variants(hq, hkv, b, max_kv_len, _fill(k_buf), d)
        med = _time_decode(hq, d, b, variants, k_buf, v_buf, max_kv_len, context, rounds, reps, gen)
        if times_out is not None:
            times_out[b] = {tile_label(v): t for v, t in zip(variants, med, strict=True)}
        best = pick_tile({None: med[0], **{i: t for i, t in enumerate(med) if i}})
        choice[b] = None if best is None else variants[best]
    set_decode_tiles(hq, hkv, d, choice)
    return choice


def choose_prefill_tile(hq: int, hkv: int, d: int, k_buf, v_buf, max_kv_len: int,
                        shapes=PREFILL_CHOICE_SHAPES, rounds: int = 3, reps: int = 3,
                        times_out: dict | None = None) -> dict | None:
    """Time ``prefill_candidates`` in the prefill form at each (sequences, new tokens) of ``shapes``, keys at
    random rows of ``k_buf``/``v_buf`` [S, Hkv, D] (the server's KV pool) with ``max_kv_len`` as the server
    passes it, alternating them over ``rounds`` rounds; install and return the fastest over the shapes
    together (``pick_tile`` against the first, the prefill's default: None when it stays). Every candidate
    gives the default's bits: this decides speed only. ``times_out`` (optional) receives {"B:NEW": {
    ``tile_label``: median ms of a graph of ``reps`` calls}}. CUDA only; call it outside CUDA-graph capture."""
    _check_layout(hq, hkv, d)
    gen = torch.Generator(device=k_buf.device).manual_seed(0)
    cands = prefill_candidates()
    total = [0.0] * len(cands)
    for b, new in shapes:
        med = _time_prefill(hq, d, b, new, cands, k_buf, v_buf, max_kv_len, rounds, reps, gen)
        total = [a + m for a, m in zip(total, med, strict=True)]
        if times_out is not None:
            times_out[f"{b}:{new}"] = {tile_label(t): m for t, m in zip(cands, med, strict=True)}
    best = pick_tile({None: total[0], **{i: t for i, t in enumerate(total) if i}})
    tile = None if best is None else cands[best]
    set_prefill_tile(hq, hkv, d, tile)
    return tile


def _check_tile(tile: dict, g: int) -> None:
    """Refuse a launch tile outside the candidates, naming every problem."""
    problems = [f"unknown key {k!r} (known: BLOCK_M, num_warps, num_stages, split, loop)" for k in tile
                if k not in ("BLOCK_M", "num_warps", "num_stages", "split", "loop")]
    if tile.get("loop", "flat") != "flat":
        problems.append(f"loop {tile['loop']!r}: 'flat' or absent (the nested loop)")
    bm = tile.get("BLOCK_M", BLOCK_M)
    if bm not in TILE_BM or bm < g:
        problems.append(f"BLOCK_M {bm}: one of {TILE_BM} and at least the head group {g}")
    if tile.get("num_warps", NUM_WARPS) not in TILE_WARPS:
        problems.append(f"num_warps {tile.get('num_warps')}: one of {TILE_WARPS}")
    if tile.get("num_stages", 1) not in TILE_STAGES:
        problems.append(f"num_stages {tile.get('num_stages')}: one of {TILE_STAGES}")
    split = tile.get("split", 1)
    if not isinstance(split, int) or isinstance(split, bool) or split < 1:
        problems.append(f"split {split!r}: a positive int (segments' programs per sequence and KV head)")
    if problems:
        raise KernelLimitError("attention: tile " + "; ".join(problems))


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _fill(t: torch.Tensor) -> int:
    """Programs a launch should reach before it stops splitting: two per SM (8 when interpreted)."""
    return 2 * _sm_count(t.device.index or 0) if t.is_cuda and not INTERPRETED else 8


def split_rule(programs: int, nseg_max: int, fill: int) -> int:
    """Programs per (sequence, tile, KV head) that share its segments: enough for ``programs`` to
    reach ``fill``, at most ``nseg_max`` (1: no split). Speed only: a split changes no bit."""
    return min(nseg_max, triton.cdiv(fill, programs)) if nseg_max > 1 and programs < fill else 1


def prefill_split(n_split: int, nseg_max: int, tq: int, hq: int, d: int) -> int:
    """The split a prefill launch keeps: ``n_split``, or none (1) where its state buffer
    (``split_state_bytes`` of its ``tq`` query tokens) would pass ``SPLIT_STATE_BYTES``. A prefill's tiles hold
    BLOCK_M / G query tokens each, so a launch of too few programs to fill the GPU may still hold hundreds of
    tokens, and its state grows with them and with the segments of its bound. Speed only: a split changes no bit."""
    return 1 if n_split > 1 and split_state_bytes(hq, tq, nseg_max * SEG, d) > SPLIT_STATE_BYTES else n_split


def attention(q, k_buf, v_buf, kv_index, q_start, q_len, q_pos0, max_q_len: int, scale=None, kv_rows=None,
              max_kv_len: int | None = None, seq_lens=None, out=None, tile: dict | None = None):
    """Launcher. q [Tq, Hq, D]; k_buf, v_buf [S, Hkv, D] (D 64 or 128; query head h reads KV head
    h // G, G = Hq / Hkv an integer <= 64: a TP rank passes its own heads, SGLang's replicated KV
    head included); kv_index [B, L] (int32/int64 rows of
    the buffers; every position 0 .. q_pos0[b] + q_len[b] - 1 must be filled); q_start, q_len,
    q_pos0 [B] (first query row, query count, absolute position of the first query);
    ``max_q_len`` >= max(q_len) (a host int: sizes the grid without a device sync).
    ``kv_rows`` [B] (optional): sequence b reads row ``kv_rows[b]`` of a larger ``kv_index``
    (SGLang's whole ``req_to_token`` pool) instead of row b -- the same slots, so the same bits,
    without gathering the rows first.
    ``seq_lens`` [B] (decode form): one query per sequence in row b of q, at position
    seq_lens[b] - 1; q_start, q_len, q_pos0 are then ignored (pass None) and max_q_len is 1.
    ``max_kv_len`` (optional host int, >= every sequence's key count): lets a launch with too few
    programs to fill the GPU split its segments over programs (split-KV). Same bits either way;
    in a split launch a sequence longer than it comes out NaN, never silently short. A split
    launch holds a state buffer of cdiv(max_kv_len, SEG) x Tq x Hq x (D + 2) fp32 (``split_state_bytes``).
    In the decode form the split rule splits only while Tq x Hkv < 2 x SMs: at most about 350 MB x G/8 for a
    40960-token bound (D 128, 132 SMs), 2.3 GB x G/8 for a 262144-token one (SGLang passes its context length); a
    split chosen at start-up beyond that holds at most ``SPLIT_STATE_BYTES``. A prefill launch splits, by the rule
    or by the tile ``choose_prefill_tile`` installed, only where its state fits ``SPLIT_STATE_BYTES``
    (``prefill_split``); a ``tile`` passed here is launched as given.
    ``out`` (optional, q's shape and dtype, unit last stride): written in place and returned
    (the caller's own output buffer: no copy).
    ``tile`` (optional): a launch tile of ``candidate_tiles`` (BLOCK_M, num_warps, num_stages) and/or
    ``split``, the programs that share a sequence's segments (needs ``max_kv_len``; clipped to its
    segments), instead of the fixed tile and the split rule: for the GPU tier and the benchmarks, which
    prove and time candidates. Without it the decode form takes the tile ``choose_decode_tiles``
    installed for this head layout and batch, if any, and the prefill form the tile ``choose_prefill_tile``
    installed for this head layout, else the fixed tile in the loop of ``set_prefill_loop`` (the same bits as
    the fixed tile, every way)."""
    tq, hq, d = q.shape
    _check_layout(hq, k_buf.shape[1], d)
    hkv = k_buf.shape[1]
    if k_buf.shape[1:] != (hkv, d) or v_buf.shape != k_buf.shape or q.dtype != k_buf.dtype:
        raise KernelLimitError("attention: k_buf and v_buf must be [S, Hkv, D] in q's dtype")
    if q.stride(-1) != 1 or k_buf.stride(-1) != 1 or v_buf.stride(-1) != 1 or kv_index.stride(-1) != 1:
        raise KernelLimitError("attention: q, k_buf, v_buf and kv_index need a unit last stride")
    decode = seq_lens is not None
    if decode and not tile and _DECODE_TILES:
        tile = decode_tile_for(q.shape[1], k_buf.shape[1], d, seq_lens.shape[0])
    given = bool(tile)
    if not decode and not tile:
        tile = prefill_tile_for(hq, k_buf.shape[1], d)
    tile = tile or {}
    if tile:
        _check_tile(tile, hq // hkv)
    bm = tile.get("BLOCK_M", BLOCK_M)
    if decode and (max_q_len != 1 or seq_lens.shape[0] > tq):
        raise KernelLimitError("attention: the decode form (seq_lens) takes one query per sequence, max_q_len=1")
    g = hq // hkv
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise KernelLimitError(f"attention: out must be {tuple(q.shape)} {q.dtype} with unit last stride")
    b = kv_index.shape[0] if kv_rows is None else kv_rows.shape[0]
    b = seq_lens.shape[0] if decode else b
    tiles = triton.cdiv(max_q_len, bm // g)
    if not (b and tiles and tq):
        return out
    programs = b * tiles * hkv
    nseg_max = triton.cdiv(max_kv_len, SEG) if max_kv_len else 0
    n_split = split_rule(programs, nseg_max, _fill(q))
    if "split" in tile:
        n_split = max(1, min(tile["split"], nseg_max))
    if not (decode or given):
        n_split = prefill_split(n_split, nseg_max, tq, hq, d)
    split = n_split > 1
    if split:
        part = torch.empty(nseg_max, tq, hq, d, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(nseg_max, tq, hq, 2, dtype=torch.float32, device=q.device)
    else:
        part = part_ml = out  # unused
    i32 = torch.int32
    dummy = seq_lens if decode else q_len
    starts, lens, pos0 = ((dummy,) * 3 if decode else (q_start.to(i32), q_len.to(i32), q_pos0.to(i32)))
    _attention_kernel[(b, tiles, hkv * n_split)](
        q, k_buf, v_buf, out, part, part_ml, kv_index, kv_rows if kv_rows is not None else dummy,  # (unused if None)
        starts, lens, pos0, seq_lens if decode else dummy, float(scale if scale is not None else 1.0 / math.sqrt(d)),
        n_split, nseg_max, tq * hq, hq, q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1), v_buf.stride(0),
        v_buf.stride(1), out.stride(0), out.stride(1), kv_index.stride(0), G=g, D=d, BLOCK_M=bm,
        BLOCK_N=BLOCK_N, SEG=SEG, HAS_ROWS=kv_rows is not None, DECODE=decode, SPLIT=split, DOT_F32=INTERPRETED,
        FLAT_LOOP=tile.get("loop") == "flat",
        num_warps=tile.get("num_warps", NUM_WARPS),
        num_stages=tile.get("num_stages", NUM_STAGES["decode" if decode else "extend"]))
    if split:
        _merge_kernel[(b, tiles, hkv)](out, part, part_ml, starts, lens, pos0, seq_lens if decode else dummy,
                                       nseg_max, tq * hq, hq, out.stride(0), out.stride(1), G=g, D=d, BLOCK_M=bm,
                                       SEG=SEG, DECODE=decode, num_warps=tile.get("num_warps", NUM_WARPS))
    return out


def contiguous_layout(batch: int, seq: int, device=None):
    """Index table and per-sequence starts for a trainer's contiguous [batch*seq, H, D] tensors."""
    kv_index = torch.arange(batch * seq, device=device, dtype=torch.int32).view(batch, seq)
    start = torch.arange(batch, device=device, dtype=torch.int32) * seq
    return kv_index, start, torch.full((batch,), seq, device=device, dtype=torch.int32), torch.zeros_like(start)
