"""Causal GQA attention over K/V read through an index table: one kernel for prefill, chunked
prefill over a cached prefix, and decode.

Math, per query (sequence b, absolute position p, query head h, KV head h // G):
  for key blocks c = 0, 1, ... of BLOCK_N keys at absolute positions [c*BLOCK_N, (c+1)*BLOCK_N):
      s  = fp32(q . k) * scale, keys after p masked to -inf
      m' = max(m, max(s));  a = exp(m - m');  P = exp(s - m')
      l  = l * a + sum(P);  acc = acc * a + bf16(P) @ v   (fp32 accumulate)
  out = bf16(acc / l)
K/V of sequence b, position j live at row ``kv_index[b, j]`` of ``k_buf``/``v_buf`` [S, Hkv, D]:
SGLang's token-indexed KV pool (``req_to_token`` rows) and a trainer's contiguous tensors
(kv_index = b*L + j) go through the same code.
Invariance: the blocks sit at fixed absolute positions from 0 and every row carries its own m,
l and acc; a row never sees how many other queries share its tile. Blocks wholly after p are an
exact no-op for that row (a = 1, P = 0), so a query computed in a full prefill, after a cached
prefix, or as a single decode step gets the same bits.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from true_on_policy.kernels.matmul import INTERPRETED

BLOCK_M = 64  # rows of a tile: (query token, query head of the group) pairs; fixed
BLOCK_N = 64  # keys per block, at absolute positions; fixed (the contract's 64-key blocks)
NUM_WARPS = 4


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
def _attention_kernel(Q, K, V, O, KV_INDEX, KV_ROWS, Q_START, Q_LEN, Q_POS0, scale,
                      stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                      stride_ib, G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      HAS_ROWS: tl.constexpr, DOT_F32: tl.constexpr):
    b = tl.program_id(0)
    tile = tl.program_id(1)
    kvh = tl.program_id(2)
    TOK: tl.constexpr = BLOCK_M // G
    n_q = tl.load(Q_LEN + b)
    if tile * TOK >= n_q:
        return
    q0 = tl.load(Q_START + b)
    p0 = tl.load(Q_POS0 + b)
    r = tl.arange(0, BLOCK_M)
    tok = tile * TOK + r // G
    row_ok = tok < n_q
    head = kvh * G + r % G
    pos = tl.where(row_ok, p0 + tok, p0)  # invalid rows see key 0 only (never stored)
    d = tl.arange(0, D)
    q_rows = (q0 + tok).to(tl.int64)
    q = tl.load(Q + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :], mask=row_ok[:, None],
                other=0.0)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    last = p0 + tl.minimum(n_q, (tile + 1) * TOK) - 1  # the tile's largest query position
    table = KV_INDEX + b.to(tl.int64) * stride_ib
    if HAS_ROWS:  # sequence b's table is row kv_rows[b] (SGLang: req_to_token[req_pool_indices[b]])
        table = KV_INDEX + tl.load(KV_ROWS + b).to(tl.int64) * stride_ib
    for start in range(0, last + 1, BLOCK_N):
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
        a = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * a + tl.sum(p, axis=1)
        pv = p.to(v.dtype)
        if DOT_F32:
            acc = acc * a[:, None] + tl.dot(pv.to(tl.float64), v.to(tl.float64)).to(tl.float32)
        else:
            acc = acc * a[:, None] + tl.dot(pv, v)
        m = m_new
    out = acc / l[:, None]
    tl.store(O + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :], out.to(O.dtype.element_ty),
             mask=row_ok[:, None])


def attention(q, k_buf, v_buf, kv_index, q_start, q_len, q_pos0, max_q_len: int, scale=None, kv_rows=None):
    """Launcher. q [Tq, Hq, D]; k_buf, v_buf [S, Hkv, D]; kv_index [B, L] (int32/int64 rows of
    the buffers; every position 0 .. q_pos0[b] + q_len[b] - 1 must be filled); q_start, q_len,
    q_pos0 [B] (first query row, query count, absolute position of the first query);
    ``max_q_len`` >= max(q_len) (a host int: sizes the grid without a device sync).
    ``kv_rows`` [B] (optional): sequence b reads row ``kv_rows[b]`` of a larger ``kv_index``
    (SGLang's whole ``req_to_token`` pool) instead of row b -- the same slots, so the same bits,
    without gathering the rows first."""
    tq, hq, d = q.shape
    hkv = k_buf.shape[1]
    if hq % hkv or BLOCK_M % (hq // hkv) or d & (d - 1) or d < 16:
        raise ValueError(f"attention: unsupported head layout Hq={hq}, Hkv={hkv}, D={d} (need Hq % Hkv == 0, "
                         f"Hq/Hkv dividing {BLOCK_M}, D a power of two >= 16)")
    if k_buf.shape[1:] != (hkv, d) or v_buf.shape != k_buf.shape or q.dtype != k_buf.dtype:
        raise ValueError("attention: k_buf and v_buf must be [S, Hkv, D] in q's dtype")
    if q.stride(-1) != 1 or k_buf.stride(-1) != 1 or v_buf.stride(-1) != 1 or kv_index.stride(-1) != 1:
        raise ValueError("attention: q, k_buf, v_buf and kv_index need a unit last stride")
    g = hq // hkv
    out = torch.empty_like(q)
    b = kv_index.shape[0] if kv_rows is None else kv_rows.shape[0]
    tiles = triton.cdiv(max_q_len, BLOCK_M // g)
    if b and tiles and tq:
        _attention_kernel[(b, tiles, hkv)](
            q, k_buf, v_buf, out, kv_index, kv_rows if kv_rows is not None else q_len,  # (unused if None)
            q_start.to(torch.int32), q_len.to(torch.int32), q_pos0.to(torch.int32),
            float(scale if scale is not None else 1.0 / math.sqrt(d)),
            q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
            out.stride(0), out.stride(1), kv_index.stride(0), G=g, D=d, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
            HAS_ROWS=kv_rows is not None, DOT_F32=INTERPRETED, num_warps=NUM_WARPS)
    return out


def contiguous_layout(batch: int, seq: int, device=None):
    """Index table and per-sequence starts for a trainer's contiguous [batch*seq, H, D] tensors."""
    kv_index = torch.arange(batch * seq, device=device, dtype=torch.int32).view(batch, seq)
    start = torch.arange(batch, device=device, dtype=torch.int32) * seq
    return kv_index, start, torch.full((batch,), seq, device=device, dtype=torch.int32), torch.zeros_like(start)
