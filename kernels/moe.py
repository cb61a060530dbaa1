"""Sparse MoE block: router, expert MLPs, fixed-order combine; single-process, TP and EP forms.

Math (per token t, contract rows moe_router / moe_experts / moe_combine):
  logits = bf16(x @ Wg^T)                         (batch-invariant GEMM)
  p      = softmax(fp32(logits))                  (fp32, over all experts)
  top-k  by value, ties to the lower expert id;   w_j = p_j / (p_0 + p_1 + ... ) (fp32, slot order)
  g, u   = bf16(x @ W13_e^T) split in half        (gate first, then up: SGLang's w13, HF's gate_up)
  h      = bf16(fp32(bf16(silu(fp32 g))) * fp32 u)  (= torch's bf16 silu(g) * u)
  e_j    = down GEMM of h with the V = 8 segment tree over the intermediate dim, kept fp32
  y      = bf16(((w_0 * e_0) + w_1 * e_1) + ...)  (fp32, slots in order 0..k-1, one rounding)
Invariance: a token's expert outputs depend only on its own row and the expert's weights (never
on how many tokens an expert received: per-expert grouped GEMM with fixed tiles). Composition
with tensor parallel (intermediate dim split over t ranks): each rank's e_j is the subtree root
of its V/t segments; the roots are all-gathered in fp32 and the tree finished in rank order
*before* the combine. Expert parallel: the rank owning an expert computes e_j in full; the
[tokens, k, hidden] slot outputs are summed over the EP group with zeros in non-owned slots
(x + 0 is exact, so this is a gather), then the same combine. Neither degree changes a bit.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from true_on_policy.kernels.limits import KernelLimitError
from true_on_policy.kernels.matmul import ALIGN, glu_fusable, grouped_matmul, matmul, matmul_reference, table_blocks
from true_on_policy.kernels.tree_reduce import finish_tree, rank_in, resolve_width, segments_for, sum_exact, world_size

HBLOCK = 512  # combine: one program per (token, HBLOCK hidden columns); elementwise over columns
# (HBLOCK and NBLOCK are speed choices from benchmarks/gemm_sweep.py; neither changes a bit)
IBLOCK = 1024  # silu*up: one row per program (real rows only), intermediate in fixed chunks
NBLOCK = 2048  # align: slots scanned in fixed chunks (the table does not depend on it)
MOE_DOWN_SHARE = 48  # one pass's fp32 down-projection output holds at most 1/48 of the GPU's memory (token_chunk)
MOE_DOWN_BYTES: int | None = None  # that bound in bytes where set (the CPU tests), else from the device
ALIGN_MIN_CHUNK = 128  # align's one-launch form: its chunk at least one slot per thread of 4 warps
# On: the gate/up GEMM stores h = silu(gate) * up where it runs on the TMA decode path (matmul.glu_fusable),
# each program computing a gate tile and its up tile: silu_mul's bits without its launch (GPU tier:
# test_silu_in_up_equals_separate). Off (the default): silu_mul's own launch after the GEMM.
# TRUE_ON_POLICY_MOE_SILU=up turns it on; benchmarks compare both (tpo_siluup against tpo).
SILU_IN_UP = False


# ---------------------------------------------------------------- references (plain torch)
def route_reference(logits: torch.Tensor, top_k: int, norm_topk: bool = True):
    p = torch.softmax(logits.float(), dim=-1)
    vals, ids = p.sort(dim=-1, descending=True, stable=True)  # stable: ties keep the lower id first
    w, ids = vals[:, :top_k], ids[:, :top_k]
    if norm_topk:
        s = w[:, 0]
        for j in range(1, top_k):
            s = s + w[:, j]
        w = w / s[:, None]
    return w, ids


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    g, u = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(g) * u  # bf16 ops: silu in fp32 rounded, product rounded


def combine_reference(e: torch.Tensor, w: torch.Tensor, out_dtype=torch.bfloat16) -> torch.Tensor:
    """e [T, k, H] fp32 slot outputs, w [T, k] fp32 -> [T, H]."""
    acc = w[:, 0, None] * e[:, 0]
    for j in range(1, e.shape[1]):
        acc = acc + w[:, j, None] * e[:, j]
    return acc.to(out_dtype)


def align_reference(ids: torch.Tensor, first_expert: int, num_local: int):
    """``align``'s table in plain torch (stable argsort); rows of unused blocks are -1 here."""
    t, k = ids.shape
    dev = ids.device
    flat = ids.reshape(-1).to(torch.int64) - first_expert
    local = (flat >= 0) & (flat < num_local)
    e = torch.where(local, flat, num_local)
    order = torch.argsort(e, stable=True)
    # counts by comparison, not index_add_/bincount: no atomics, no host sync
    counts = (e[:, None] == torch.arange(num_local, device=dev)[None, :]).sum(0)
    blocks = (counts + ALIGN - 1) // ALIGN
    start_block = torch.cumsum(blocks, 0) - blocks
    start_count = torch.cumsum(counts, 0) - counts
    n_blocks = table_blocks(t * k, num_local)
    se = e[order]
    valid = se < num_local
    sec = se.clamp(max=num_local - 1)
    dest = start_block[sec] * ALIGN + torch.arange(t * k, device=dev) - start_count[sec]
    dest = torch.where(valid, dest, n_blocks * ALIGN)
    rows = torch.full((n_blocks * ALIGN + 1,), -1, dtype=torch.int64, device=dev)
    rows.scatter_(0, dest, order // k)
    pos = torch.full((t * k,), -1, dtype=torch.int64, device=dev)
    pos.scatter_(0, order, torch.where(valid, dest, -1))
    be = torch.searchsorted(torch.cumsum(blocks, 0), torch.arange(n_blocks, device=dev), right=True)
    be = torch.where(be < num_local, be, -1)
    return rows[:-1], be.to(torch.int32), pos


def moe_reference(x, router_w, w13, w2, top_k, norm_topk=True, acc=torch.float32, width: int | None = None):
    """Whole block, one process, expert by expert in plain torch (GEMMs accumulated in ``acc``;
    ``width``: the down projection's V, None: ``tree_reduce.tree_width()``)."""
    segments = resolve_width(width)
    logits = matmul_reference(x, router_w, acc=acc)
    w, ids = route_reference(logits, top_k, norm_topk)
    e = torch.zeros(x.shape[0], top_k, x.shape[1], dtype=torch.float32, device=x.device)
    for ex in range(w13.shape[0]):
        t, j = torch.where(ids == ex)
        if t.numel():
            h = silu_mul_reference(matmul_reference(x[t], w13[ex], acc=acc))
            e[t, j] = matmul_reference(h, w2[ex], torch.float32, segments=segments, acc=acc)
    return combine_reference(e, w, x.dtype)


# ---------------------------------------------------------------- kernels
@triton.jit
def _route_kernel(LOGITS, W_OUT, ID_OUT, stride_l, E, K: tl.constexpr, KP: tl.constexpr,
                  BLOCK_E: tl.constexpr, NORM: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_E)
    z = tl.load(LOGITS + row * stride_l + offs, mask=offs < E, other=float("-inf")).to(tl.float32)
    ez = tl.exp(z - tl.max(z, axis=0))
    p = ez / tl.sum(ez, axis=0)
    p = tl.where(offs < E, p, -2.0)
    slots = tl.arange(0, KP)
    wk = tl.zeros([KP], dtype=tl.float32)
    ik = tl.zeros([KP], dtype=tl.int32)
    total = 0.0
    for j in tl.static_range(K):
        best = tl.max(p, axis=0)
        idx = tl.min(tl.where(p == best, offs, BLOCK_E), axis=0)  # ties: the lower expert id
        wk = tl.where(slots == j, best, wk)
        ik = tl.where(slots == j, idx, ik)
        total = total + best  # slot order
        p = tl.where(offs == idx, -1.0, p)
    if NORM:
        wk = wk / total
    tl.store(W_OUT + row * K + slots, wk, mask=slots < K)
    tl.store(ID_OUT + row * K + slots, ik, mask=slots < K)


@triton.jit
def silu_times_up(g, u):
    """h = bf16(fp32(bf16(silu(fp32 g))) * fp32 u), elementwise on gate and up values (bf16): the one
    formula ``silu_mul`` and the gate/up GEMM's GLU epilogue (``grouped_matmul(glu=True)``) share."""
    g = g.to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(u.dtype)
    return (s.to(tl.float32) * u.to(tl.float32)).to(u.dtype)


@triton.jit
def _silu_mul_kernel(GU, OUT, ROWS, stride_g, stride_o, I, HAS_ROWS: tl.constexpr, IBLOCK: tl.constexpr):
    """Program i computes table row ROWS[i] (the expert table's real rows: one program per routed
    slot, none for padding; -1 = a slot of another rank's expert, skipped), or row i without
    ROWS. Elementwise: a row's bits never depend on which program computes it."""
    if HAS_ROWS:
        row = tl.load(ROWS + tl.program_id(0)).to(tl.int64)
        if row < 0:
            return
    else:
        row = tl.program_id(0).to(tl.int64)
    for start in range(0, I, IBLOCK):
        cols = start + tl.arange(0, IBLOCK)
        m = cols < I
        g = tl.load(GU + row * stride_g + cols, mask=m, other=0.0)
        u = tl.load(GU + row * stride_g + I + cols, mask=m, other=0.0)
        tl.store(OUT + row * stride_o + cols, silu_times_up(g, u), mask=m)


@triton.jit
def _combine_kernel(E_OUT, POS, W, Y, stride_e, stride_y, H, K: tl.constexpr, HBLOCK: tl.constexpr):
    """Program (t, c): token t, hidden columns [c * HBLOCK, (c + 1) * HBLOCK). Each element sums
    its k slots in slot order; the column split changes no element."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * HBLOCK + tl.arange(0, HBLOCK)
    m = cols < H
    acc = tl.zeros([HBLOCK], dtype=tl.float32)
    for j in tl.static_range(K):
        p = tl.load(POS + t * K + j).to(tl.int64)
        wj = tl.load(W + t * K + j)
        e = tl.load(E_OUT + p * stride_e + cols, mask=m, other=0.0)
        prod = wj * e
        acc = acc + prod
    tl.store(Y + t * stride_y + cols, acc.to(Y.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=["N"])
def _count_kernel(IDS, COUNTS, N, FIRST, NBLOCK: tl.constexpr):
    e = tl.program_id(0)
    total = 0
    for start in range(0, N, NBLOCK):
        offs = start + tl.arange(0, NBLOCK)
        total += tl.sum((tl.load(IDS + offs, mask=offs < N, other=-1) == FIRST + e).to(tl.int32), axis=0)
    tl.store(COUNTS + e, total)


@triton.jit(do_not_specialize=["N"])
def _align_kernel(IDS, COUNTS, ROWS, OWN, BLOCK_EXPERT, POS, N, K, FIRST, E, N_BLOCKS, ALIGN: tl.constexpr,
                  NBLOCK: tl.constexpr, BLOCK_E: tl.constexpr, COUNT: tl.constexpr):
    """Program e < E: expert e's slots, in slot order, to rows [base, base + count) of its
    group (base = ALIGN x the blocks of experts before it; OWN holds the row's own index, the
    down GEMM's table), its padding rows -1, its blocks marked e. Program E: blocks after the
    last group marked -1, slots of non-local experts -1. COUNT (N <= NBLOCK): every program
    counts the local experts' slots itself (one histogram of the one chunk; COUNTS is unused),
    else COUNTS holds them (``_count_kernel``). Counts are integers: either way the same table."""
    e = tl.program_id(0)
    ex = tl.arange(0, BLOCK_E)
    if COUNT:
        so = tl.arange(0, NBLOCK)
        x = tl.load(IDS + so, mask=so < N, other=FIRST) - FIRST
        local = (so < N) & (x >= 0) & (x < E)
        counts = tl.histogram(tl.where(local, x, 0), BLOCK_E, mask=local)
    else:
        counts = tl.load(COUNTS + ex, mask=ex < E, other=0)
    blocks = (counts + ALIGN - 1) // ALIGN
    if e < E:
        first_block = tl.sum(tl.where(ex < e, blocks, 0), axis=0)
        base = first_block.to(tl.int64) * ALIGN
        count = tl.sum(tl.where(ex == e, counts, 0), axis=0)
        n_mine = tl.sum(tl.where(ex == e, blocks, 0), axis=0)
        seen = 0
        for start in range(0, N, NBLOCK):
            offs = start + tl.arange(0, NBLOCK)
            mine = tl.load(IDS + offs, mask=offs < N, other=-1) == FIRST + e
            dest = base + seen + tl.cumsum(mine.to(tl.int32), axis=0) - 1
            tl.store(ROWS + dest, (offs // K).to(tl.int64), mask=mine)
            tl.store(OWN + dest, dest, mask=mine)
            tl.store(POS + offs, dest, mask=mine)
            seen += tl.sum(mine.to(tl.int32), axis=0)
        pad = count + tl.arange(0, ALIGN)
        tl.store(ROWS + base + pad, tl.full([ALIGN], -1, tl.int64), mask=pad < n_mine * ALIGN)
        tl.store(OWN + base + pad, tl.full([ALIGN], -1, tl.int64), mask=pad < n_mine * ALIGN)
        for b in range(0, n_mine, NBLOCK):
            bo = b + tl.arange(0, NBLOCK)
            tl.store(BLOCK_EXPERT + first_block + bo, tl.full([NBLOCK], 0, tl.int32) + e, mask=bo < n_mine)
    else:
        used = tl.sum(blocks, axis=0)
        for b in range(used, N_BLOCKS, NBLOCK):
            bo = b + tl.arange(0, NBLOCK)
            tl.store(BLOCK_EXPERT + bo, tl.full([NBLOCK], -1, tl.int32), mask=bo < N_BLOCKS)
        for start in range(0, N, NBLOCK):
            offs = start + tl.arange(0, NBLOCK)
            x = tl.load(IDS + offs, mask=offs < N, other=FIRST)
            tl.store(POS + offs, tl.full([NBLOCK], -1, tl.int64), mask=(offs < N) & ((x < FIRST) | (x >= FIRST + E)))


# ---------------------------------------------------------------- launchers
def route(logits: torch.Tensor, top_k: int, norm_topk: bool = True):
    """logits [T, E] (bf16) -> (weights fp32 [T, k], expert ids int32 [T, k])."""
    t, e = logits.shape
    if not 0 < top_k <= e or e > 1024:
        raise KernelLimitError(f"route: need 0 < top_k <= experts <= 1024, got top_k={top_k}, experts={e}")
    w = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int32, device=logits.device)
    if t:
        _route_kernel[(t,)](logits, w, ids, logits.stride(0), e, K=top_k, KP=triton.next_power_of_2(top_k),
                            BLOCK_E=triton.next_power_of_2(e), NORM=norm_topk)
    return w, ids


def silu_mul(gate_up: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """bf16 silu(gate) * up per row; with ``rows`` (``align``'s ``pos``: the table row of every
    routed slot, -1 for another rank's expert) only those rows are computed, one program each;
    the others (padding) are left undefined."""
    p, two_i = gate_up.shape
    out = torch.empty(p, two_i // 2, dtype=gate_up.dtype, device=gate_up.device)
    n = rows.shape[0] if rows is not None else p
    if n:
        _silu_mul_kernel[(n,)](gate_up, out, rows if rows is not None else gate_up, gate_up.stride(0), out.stride(0),
                               two_i // 2, HAS_ROWS=rows is not None, IBLOCK=IBLOCK)
    return out


def combine(e_out: torch.Tensor, pos: torch.Tensor, w: torch.Tensor, out_dtype=torch.bfloat16,
            hblock: int = HBLOCK) -> torch.Tensor:
    """y[t] = sum_j w[t, j] * e_out[pos[t, j]] in fp32, slot order, one rounding. ``hblock``: the
    columns per program (elementwise, so any width computes the same bits; ``benchmarks/gemm_sweep.py``
    times the candidates and checks their bits)."""
    t, k = w.shape
    h = e_out.shape[1]
    y = torch.empty(t, h, dtype=out_dtype, device=e_out.device)
    if t:
        _combine_kernel[(t, triton.cdiv(h, hblock))](e_out, pos.contiguous(), w.contiguous(), y, e_out.stride(0),
                                                     y.stride(0), h, K=k, HBLOCK=hblock)
    return y


def align(ids: torch.Tensor, first_expert: int, num_local: int, nblock: int = NBLOCK):
    """Expert-sorted row table, sync-free (CUDA-graph safe), padded per expert to ALIGN rows.

    Returns rows [P] (token index or -1), block_expert [P/ALIGN] (local expert or -1), pos [T*k]
    (row of slot (t, j) in the table, -1 when the expert is not local) and own [P] (the down GEMM's
    table: each real row's own index, padding -1). Within an expert, slots keep (token, slot)
    order. P is a static bound: ceil(T*k/ALIGN) + num_local blocks. ``_align_kernel`` runs one
    program per local expert, plus one for the unused blocks and the slots of other ranks' experts;
    rows of unused blocks are undefined. Up to ``nblock`` slots (a decode step) it counts the slots
    itself, in one launch; above, ``_count_kernel`` counts them first. ``nblock``: the slots each
    program scans per step (the table does not depend on it; ``benchmarks/gemm_sweep.py`` times
    the candidates and checks the tables are equal).
    """
    t, k = ids.shape
    n = t * k
    dev = ids.device
    n_blocks = table_blocks(n, num_local)
    rows = torch.empty(n_blocks * ALIGN, dtype=torch.int64, device=dev)
    own_rows = torch.empty_like(rows)
    block_expert = torch.empty(n_blocks, dtype=torch.int32, device=dev)
    pos = torch.empty(n, dtype=torch.int64, device=dev)
    flat = ids.reshape(-1).to(torch.int32)
    one_chunk = n <= nblock
    if one_chunk:  # the align kernel counts (COUNT): one launch; its chunk the smallest power of two >= n
        counts, nblock = flat, max(ALIGN_MIN_CHUNK, triton.next_power_of_2(max(n, 1)))
    else:
        counts = torch.empty(num_local, dtype=torch.int32, device=dev)
        _count_kernel[(num_local,)](flat, counts, n, first_expert, NBLOCK=nblock)
    _align_kernel[(num_local + 1,)](flat, counts, rows, own_rows, block_expert, pos, n, k, first_expert, num_local,
                                    n_blocks, ALIGN=ALIGN, NBLOCK=nblock, BLOCK_E=triton.next_power_of_2(num_local),
                                    COUNT=one_chunk)
    return rows, block_expert, pos, own_rows


def tp_shard(w13: torch.Tensor, w2: torch.Tensor, rank: int, world: int):
    """Rank ``rank``'s slice of the intermediate dim under expert TP (SGLang's layout): the
    matching rows of both halves of w13 ([gate; up]) and columns of w2."""
    inter = w2.shape[2]
    a, b = rank * inter // world, (rank + 1) * inter // world
    return torch.cat([w13[:, a:b], w13[:, inter + a:inter + b]], 1).contiguous(), w2[:, :, a:b].contiguous()


def expert_outputs(x, ids, w13, w2, first_expert: int, segments: int, width: int | None = None) -> torch.Tensor:
    """fp32 [T*k, H] slot-major outputs of this rank's experts (their subtree roots when the
    intermediate dim is sharded); zero in the slots of experts owned elsewhere. ``width``: the
    tree's V (None: ``tree_reduce.tree_width()``)."""
    rows, block_expert, pos, own = align(ids, first_expert, w13.shape[0])
    e_sorted = _expert_sorted(x, rows, own, pos, block_expert, w13, w2, segments, width)
    return torch.where((pos >= 0)[:, None], e_sorted[pos.clamp(min=0)], 0.0)


def _expert_sorted(x, rows, own, pos, block_expert, w13, w2, segments, width):
    # tokens and slots (T x k, the pairs ``align`` placed) choose the grouped GEMMs' tiles (matmul.grouped_tiles)
    t, slots = x.shape[0], pos.shape[0]
    if SILU_IN_UP and glu_fusable(x, w13, t, slots):  # h stored by the gate/up GEMM: silu_mul's rows, no launch
        h = grouped_matmul(x, w13, rows, block_expert, tokens=t, slots=slots, glu=True)
    else:
        h = silu_mul(grouped_matmul(x, w13, rows, block_expert, tokens=t, slots=slots), pos)
    # V = 1 (one segment, no TP of the experts): the plain grouped GEMM, one fp32 K loop; at tree
    # width 1 (the flat contract) as the down projection's role (its tiles above the decode path:
    # matmul.moe_tile); at tree width 2 with both segments here, the two-segment TMA form (role "tree2")
    v = resolve_width(width)
    role = "down" if v == 1 else "tree2" if v == 2 and segments == 2 else "plain"
    return grouped_matmul(h, w2, own, block_expert, torch.float32, segments, tree=segments > 1,
                          role=role, tokens=t, slots=slots)


def down_bytes(t: int, k: int, h: int, num_local: int) -> int:
    """The fp32 down-projection output of ``t`` tokens: the expert-sorted table's rows (``align``), ``h`` wide."""
    return table_blocks(t * k, num_local) * ALIGN * h * 4


@functools.cache
def _device_bytes(index: int) -> int:
    return torch.cuda.get_device_properties(index).total_memory


def down_cap(x: torch.Tensor) -> int | None:
    """``MOE_DOWN_BYTES`` where set, else 1/``MOE_DOWN_SHARE`` of x's GPU (80 GB: 1.65 GiB; 141 GB: 2.9 GiB); None
    (no bound) off the GPU."""
    if MOE_DOWN_BYTES is not None:
        return MOE_DOWN_BYTES
    return _device_bytes(x.device.index or 0) // MOE_DOWN_SHARE if x.is_cuda else None


def token_chunk(t: int, k: int, h: int, num_local: int, cap: int | None) -> int:
    """Tokens the block takes in one pass: all ``t``, unless its fp32 down-projection output (``down_bytes``)
    would pass ``cap`` bytes (``down_cap``); then ``t`` in equal chunks (the last shorter) that keep it under, at
    least one block of ALIGN slots each. A prefill chunk of a wide model (8,192 tokens x 8 slots of 6,144 fp32
    columns: 2.1 GB) is the activation peak of the whole forward, above what SGLang leaves beside its KV pool on an
    80 GB GPU.
    Memory only: every token's bits are the same in any chunk. Every rank of a TP or EP group takes the same
    chunks (the same T, k, H, local experts and GPU model), so the same collectives."""
    if cap is None or down_bytes(t, k, h, num_local) <= cap:
        return t
    blocks = max(1, cap // (h * 4) // ALIGN - num_local)  # blocks of slots beside the experts' padding
    most = max(1, blocks * ALIGN // k)
    return triton.cdiv(t, triton.cdiv(t, most))


def moe(x, router_w, w13, w2, top_k, norm_topk=True, tp_group=None, ep_group=None, width: int | None = None):
    """The block. x [T, H] (all tokens, on every rank); router_w [E, H] (all experts);
    w13 [E_local, 2*I/tp, H], w2 [E_local, H, I/tp] (this rank's experts and intermediate slice).
    EP rank r owns experts [r*E_local, (r+1)*E_local). Same bits for every TP and EP degree.
    ``width``: the down projection's V (None: ``tree_reduce.tree_width()``). Tokens in chunks where the down
    projection's output would pass its bound (``token_chunk``)."""
    e_total, e_local = router_w.shape[0], w13.shape[0]
    ep = world_size(ep_group)
    if e_local * ep != e_total:
        raise KernelLimitError(f"moe: {e_local} local experts x EP {ep} != {e_total} router experts")
    t = x.shape[0]
    chunk = token_chunk(t, top_k, x.shape[1], e_local, down_cap(x))
    if chunk < t:  # in token chunks, one after another (each rank the same chunks, so the same collectives)
        return torch.cat([moe(x[i:i + chunk], router_w, w13, w2, top_k, norm_topk, tp_group, ep_group, width)
                          for i in range(0, t, chunk)])
    segments = segments_for(world_size(tp_group), w2.shape[2], width)
    w, ids = route(matmul(x, router_w, role="router"), top_k, norm_topk)
    if world_size(tp_group) == 1 and ep == 1:  # no copy to slot-major: the combine reads through pos
        rows, block_expert, pos, own = align(ids, 0, e_local)
        return combine(_expert_sorted(x, rows, own, pos, block_expert, w13, w2, segments, width), pos.view(-1, top_k), w,
                       x.dtype)
    first = rank_in(ep_group) * e_local
    e = finish_tree(expert_outputs(x, ids, w13, w2, first, segments, width), tp_group)
    e = sum_exact(e, ep_group)  # each slot is non-zero on exactly one EP rank
    return combine(e, torch.arange(e.shape[0], device=x.device).view(-1, top_k), w, x.dtype)
