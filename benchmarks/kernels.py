"""Kernel benchmark at Qwen3-30B-A3B shapes: our invariant kernels vs the usual fast path.

    PYTHONPATH=.:$PYTHONPATH python benchmarks/kernels.py [--tokens 1 64 4096] [--tree-width 8] [--out bench.json]

``--tree-width 1`` times the flat contract's forms (o_proj one plain GEMM, the MoE down
projection one plain grouped GEMM); the width is set once per process, so each width is its own run.

Prints one table: op, tokens, our median time, the baseline's median time and the speed ratio
(baseline time / our time; 1.0 = as fast). Medians of ``triton.testing.do_bench_cudagraph``
(``--timing graph``, the default: the GPU's time, as in graph-captured decode) or of
``do_bench`` (``--timing eager``: launch overhead included), both sides in the same process on
the same inputs. Baselines: cuBLAS through
torch for GEMMs, SGLang 0.5.17's Triton kernels (decode attention, fused MoE) and sgl-kernel's
RMSNorm where importable, torch SDPA for prefill attention, torch for the rest.
"""

from __future__ import annotations

import argparse
import math

import torch
import triton
from true_on_policy.kernels.attention import attention, contiguous_layout
from true_on_policy.kernels.logprobs import token_logprobs
from true_on_policy.kernels.matmul import matmul
from true_on_policy.kernels.moe import moe
from true_on_policy.kernels.rmsnorm import rmsnorm
from true_on_policy.kernels.rope import apply_rope, apply_rope_reference, cos_sin
from true_on_policy.kernels.sampling import sample
from true_on_policy.kernels.tree_reduce import row_linear, tree_width, use_tree_width

H, HQ, HKV, D, E, K, INTER, VOCAB, CTX, MAX_CTX = 2048, 32, 4, 128, 128, 8, 768, 151936, 1024, 40960


TIMING = {"mode": "graph"}


def _bench(fn):
    """Median ms of ``fn``. "graph": replays of a captured CUDA graph (the GPU's time, as in the
    rollout's graph-captured decode; launch overhead off both sides); "eager": plain launches.
    A function that cannot be captured falls back to eager, and the row says so."""
    if TIMING["mode"] == "graph":
        try:
            with torch.cuda.stream(torch.cuda.Stream()):
                return triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median")
        except Exception as e:  # noqa: BLE001  (recorded, then timed eagerly)
            TIMING.setdefault("eager_fallbacks", []).append(f"{type(e).__name__}: {str(e)[:80]}")
            torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def _r(*shape, scale=1.0):
    return (torch.randn(*shape, device="cuda") * scale).bfloat16()


IMPORT_ERRORS: dict[str, str] = {}


def _try(name, fn):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001  (reported in the table, not fatal)
        IMPORT_ERRORS[name] = f"{type(e).__name__}: {str(e)[:100]}"
        return None


def _sgl_rmsnorm():
    def imp():
        from sgl_kernel import rmsnorm as f
        return f
    f = _try("sgl_kernel.rmsnorm", imp)
    return ("sgl_kernel.rmsnorm", f) if f else (None, None)


def _sgl_decode():
    def imp():
        from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd
        return decode_attention_fwd
    return _try("sglang decode_attention_fwd", imp)


def _sgl_one_rank_world():
    import socket

    from sglang.srt.distributed import parallel_state as ps

    if ps._TP is not None:
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="nccl",
                                    distributed_init_method=f"tcp://127.0.0.1:{port}")
    ps.initialize_model_parallel(tensor_model_parallel_size=1)


def _sgl_fused_moe():
    def imp():
        from sglang.srt.layers.moe.moe_runner.base import MoeRunnerConfig
        from sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe import fused_moe
        from sglang.srt.layers.moe.topk import StandardTopKOutput
        from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

        from true_on_policy import tiny_model

        # fused_moe reads SGLang's published runtime config and allocates its output through the
        # TP group (symmetric-memory hook): publish a default config, start a one-rank world
        set_global_server_args_for_scheduler(ServerArgs(model_path=tiny_model.ensure(), device="cuda"))
        _sgl_one_rank_world()
        return fused_moe, MoeRunnerConfig, StandardTopKOutput
    return _try("sglang fused_moe", imp)


SWEEP = [dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3),
         dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3),
         dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4),
         dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=4),
         dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4),
         dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, num_warps=4, num_stages=5),
         dict(BLOCK_M=256, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3),
         dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=2)]


TMA_SWEEP = [dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3),
             dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=4),
             dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4),
             dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4),
             dict(BLOCK_M=256, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3),
             dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4),
             dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=64, num_warps=4, num_stages=4)]


def sweep(tokens):
    """Tile candidates for the fixed configs (speed only), and whether each candidate gives the
    same bits as the first one (a role may pick its own fixed tiles either way; this says
    whether the choice is also numerically free)."""
    from true_on_policy.kernels.matmul import _launch, _launch_tma
    print("\n| GEMM | tokens | config | ms | cuBLAS ms | speed | bits == first |\n|---|---:|---|---:|---:|---:|---|")
    rows = []

    def record(op, t, tag, cfg, ms, base, same):
        tag += "x".join(str(cfg[a]) for a in ("BLOCK_M", "BLOCK_N", "BLOCK_K")) + \
            f" w{cfg['num_warps']} s{cfg['num_stages']}"
        print(f"| {op} | {t} | {tag} | {ms:.4f} | {base:.4f} | {base / ms:.2f} | {same} |")
        rows.append({"op": op, "tokens": t, "config": tag, "ms": ms, "cublas_ms": base, "same_bits": same})

    for t in tokens:
        for op, n, k, seg in (("qkv", 5120, H, 1), ("lm_head", VOCAB, H, 1), ("o_proj split x8", H, HQ * D, 8)):
            x, w = _r(t, k), _r(n, k, scale=0.02)
            base = _bench(lambda x=x, w=w: x @ w.T)
            first = None
            for cfg in SWEEP:
                out = torch.empty((seg, t, n) if seg > 1 else (t, n), dtype=torch.float32 if seg > 1 else x.dtype,
                                  device="cuda")
                ms = _bench(lambda x=x, w=w, out=out, cfg=cfg, t=t, seg=seg: _launch(x, w, out, None, None, t, seg, cfg, seg > 1))
                first = out.clone() if first is None else first
                record(op, t, "", cfg, ms, base, torch.equal(out, first))
            for cfg in TMA_SWEEP if seg == 1 else ():
                out = torch.empty(t, n, dtype=x.dtype, device="cuda")
                try:
                    ms = _bench(lambda x=x, w=w, out=out, cfg=cfg: _launch_tma(x, w, out, cfg))
                except Exception as e:  # noqa: BLE001  (a candidate that does not compile is reported)
                    print(f"| {op} | {t} | TMA {cfg} | failed: {type(e).__name__}: {str(e)[:80]} |")
                    continue
                record(op, t, "TMA ", cfg, ms, base, torch.equal(out, first))
            del first
            torch.cuda.empty_cache()
    return rows


def _decode_case(t):
    """Decode of t sequences, CTX keys each, one query each, in a shuffled paged pool."""
    kb, vb = _r(t * CTX, HKV, D), _r(t * CTX, HKV, D)
    table = torch.randperm(t * CTX, device="cuda").int().view(t, CTX)
    return _r(t, HQ, D), kb, vb, table, torch.full((t,), CTX, device="cuda", dtype=torch.int32)


def rows_for(t):
    out = []
    x = _r(t, H)
    w = (1 + 0.1 * torch.randn(H, device="cuda")).bfloat16()
    name, f = _sgl_rmsnorm()
    base = (name, lambda: f(x, w, 1e-6)) if f else ("torch (HF order)", lambda: (
        w * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16()))
    out.append(("rmsnorm", t, lambda: rmsnorm(x, w, 1e-6), *base))
    for op, n, k, role in (("qkv_proj GEMM", (HQ + 2 * HKV) * D, H, "plain"), ("router GEMM", E, H, "router"),
                           ("lm_head GEMM", VOCAB, H, "lm_head")):
        xa, wa = _r(t, k), _r(n, k, scale=0.02)
        out.append((op, t, lambda xa=xa, wa=wa, role=role: matmul(xa, wa, role=role), "cuBLAS (torch.mm)",
                    lambda xa=xa, wa=wa: xa @ wa.T))
    xo, wo = _r(t, HQ * D), _r(H, HQ * D, scale=0.02)
    o_name = "o_proj GEMM + tree (TP1)" if tree_width() > 1 else "o_proj GEMM (tree width 1)"
    out.append((o_name, t, lambda: row_linear(xo, wo), "cuBLAS (torch.mm)", lambda: xo @ wo.T))
    q = _r(t, HQ + HKV, D)
    c, s = cos_sin(torch.arange(t, device="cuda"), D, 1e6)
    out.append(("rope (q and k heads)", t, lambda: apply_rope(q, c, s), "torch fp32 (reference)",
                lambda: apply_rope_reference(q, c, s)))
    qp, kp, vp = _r(t, HQ, D), _r(t, HKV, D), _r(t, HKV, D)
    lay = contiguous_layout(1, t, "cuda")
    qs, ks, vs = qp.transpose(0, 1)[None], kp.transpose(0, 1)[None], vp.transpose(0, 1)[None]
    out.append(("attention prefill (1 seq)", t, lambda: attention(qp, kp, vp, *lay, t), "torch SDPA (flash)",
                lambda: torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)))
    # decode: t sequences, CTX keys each, one query each, paged pool
    qd, kb, vb, table, seq_lens = _decode_case(t)
    dec = _sgl_decode()
    if dec:
        splits = 8
        o = torch.empty_like(qd)
        indptr = torch.arange(t + 1, device="cuda", dtype=torch.int32) * CTX
        logits = torch.empty(t, HQ, splits, D, dtype=torch.float32, device="cuda")
        lse = torch.empty(t, HQ, splits, dtype=torch.float32, device="cuda")
        nsplit = torch.full((t,), splits, dtype=torch.int32, device="cuda")
        flat = table.reshape(-1).contiguous()
        base = ("sglang triton decode", lambda: dec(qd, kb, vb, o, indptr, flat, logits, lse, nsplit, splits,
                                                    1 / math.sqrt(D), 1.0, 1.0))
    else:
        base = ("n/a (sglang not importable)", None)
    # ours as the rollout calls it: the decode form, bounded by Qwen3-30B-A3B's 40960-token context
    # (the width of SGLang's req_to_token), which lets a small batch split its KV segments
    out.append((f"attention decode (ctx {CTX})", t, lambda: attention(qd, kb, vb, table, None, None, None, 1,
                                                                       max_kv_len=MAX_CTX, seq_lens=seq_lens), *base))
    xm, rw = _r(t, H), _r(E, H, scale=0.05)
    w13, w2 = _r(E, 2 * INTER, H, scale=0.03), _r(E, H, INTER, scale=0.03)
    fm = _sgl_fused_moe()
    if fm:
        fused_moe, cfg, topk_out = fm

        def base_moe():
            lg = xm @ rw.T
            wts, ids = torch.topk(torch.softmax(lg.float(), -1), K, -1)
            wts = wts / wts.sum(-1, keepdim=True)
            return fused_moe(xm, w13, w2, topk_out(wts, ids.int(), lg), cfg(inplace=False))
        base = ("router (torch) + sglang fused_moe", base_moe)
    else:
        base = ("n/a (sglang not importable)", None)
    moe_name = "MoE block (E128 top8)" + ("" if tree_width() > 1 else ", tree width 1")
    out.append((moe_name, t, lambda: moe(xm, rw, w13, w2, K), *base))
    lg, tok = _r(t, VOCAB, scale=3), torch.randint(0, VOCAB, (t,), device="cuda")
    out.append(("token log-probs", t, lambda: token_logprobs(lg, tok, 0.7, validate=False), "torch log_softmax+gather",
                lambda: torch.log_softmax(lg.float() / 0.7, -1).gather(-1, tok[:, None])))
    lf = lg.float()
    seeds, pos = torch.arange(t, device="cuda"), torch.full((t,), 100, device="cuda")

    def stock_sample():  # SGLang's pytorch sampling backend at T=0.7 with log-probs: softmax, draw, log_softmax
        probs = torch.softmax(lf / 0.7, -1)
        ids = torch.multinomial(probs, 1)
        return ids, torch.log_softmax(lf / 0.7, -1).gather(-1, ids)
    out.append(("sample + its log-prob (T=0.7)", t, lambda: sample(lf, 0.7, seeds, pos, truncating=False),
                "torch softmax+multinomial+log_softmax", stock_sample))
    return out


def attention_sweep():
    """Attention configs (segment size, warps, pipeline stages): speed of decode (1 and 64
    sequences, ctx CTX) and a 4096-token prefill, and whether each config gives the bits of the
    first config with the same segment size (the segment size is numerics; the rest may not be)."""
    from true_on_policy.kernels import attention as att
    print("\n| SEG | warps | stages | decode 1 ms | decode 64 ms | prefill 4096 ms | bits == first of SEG |\n"
          "|---:|---:|---:|---:|---:|---:|---|")
    keep = (att.SEG, att.NUM_WARPS, att.NUM_STAGES)
    cases = []
    for t in (1, 64):
        cases.append(_decode_case(t))
    qp, kp, vp = _r(4096, HQ, D), _r(4096, HKV, D), _r(4096, HKV, D)
    lay = contiguous_layout(1, 4096, "cuda")
    rows, first = [], {}
    for seg in (128, 256):
        for warps in (4, 8):
            for stages in (1, 2, 3, 4):
                att.SEG, att.NUM_WARPS, att.NUM_STAGES = seg, warps, {"decode": stages, "extend": stages}
                fns = [lambda c=c: att.attention(c[0], c[1], c[2], c[3], None, None, None, 1, max_kv_len=MAX_CTX,
                                                 seq_lens=c[4]) for c in cases]
                fns.append(lambda: att.attention(qp, kp, vp, *lay, 4096))
                try:
                    outs = [f() for f in fns]
                    ms = [_bench(f) for f in fns]
                except Exception as e:  # noqa: BLE001  (a config that does not compile is reported)
                    print(f"| {seg} | {warps} | {stages} | failed: {type(e).__name__}: {str(e)[:80]} |")
                    continue
                ref = first.setdefault(seg, outs)
                same = all(torch.equal(a, b) for a, b in zip(outs, ref, strict=True))
                print(f"| {seg} | {warps} | {stages} | {ms[0]:.4f} | {ms[1]:.4f} | {ms[2]:.4f} | {same} |")
                rows.append({"seg": seg, "num_warps": warps, "num_stages": stages, "decode1_ms": ms[0],
                             "decode64_ms": ms[1], "prefill4096_ms": ms[2], "same_bits_as_first_of_seg": same})
    att.SEG, att.NUM_WARPS, att.NUM_STAGES = keep
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 4096])
    ap.add_argument("--out")
    ap.add_argument("--sweep", action="store_true", help="also time GEMM tile candidates")
    ap.add_argument("--sweep-only", action="store_true", help="only the GEMM tile candidates")
    ap.add_argument("--timing", choices=("graph", "eager"), default="graph",
                    help="graph: CUDA-graph replays, the GPU's time (default); eager: plain launches")
    ap.add_argument("--attention-sweep", action="store_true", help="only the attention configs")
    ap.add_argument("--tree-width", type=int, choices=(1, 8), default=8,
                    help="the contract's tree width: 8 (qwen3_moe_true_on_policy_v1), 1 (the flat contract)")
    args = ap.parse_args(argv)
    from true_on_policy.harness.provenance import provenance, write_evidence

    use_tree_width(args.tree_width)

    prov = provenance(None if argv is None else ["python", "benchmarks/kernels.py", *argv])
    TIMING["mode"] = args.timing
    if args.attention_sweep:
        rows = attention_sweep()
        if args.out:
            write_evidence(args.out, {"timing": TIMING, "attention_sweep": rows}, prov)
        return
    table = []
    for t in () if args.sweep_only else args.tokens:
        for op, n, ours, base_name, base in rows_for(t):
            fallbacks = len(TIMING.get("eager_fallbacks", ()))
            ours_ms = _bench(ours)
            try:
                base_ms = _bench(base) if base else float("nan")
            except Exception as e:  # noqa: BLE001  (a baseline's failure is reported, not fatal)
                base_name, base_ms = f"{base_name}: {type(e).__name__}: {str(e)[:80]}", float("nan")
            mode = args.timing if len(TIMING.get("eager_fallbacks", ())) == fallbacks else "eager (fallback)"
            table.append({"op": op, "tokens": n, "ours_ms": ours_ms, "baseline": base_name, "baseline_ms": base_ms,
                          "speed_ratio": base_ms / ours_ms, "timing": mode})
            torch.cuda.empty_cache()
    print("| op | tokens | ours ms | baseline | baseline ms | speed (base/ours) | timing |\n"
          "|---|---:|---:|---|---:|---:|---|")
    for r in table:
        print(f"| {r['op']} | {r['tokens']} | {r['ours_ms']:.4f} | {r['baseline']} | {r['baseline_ms']:.4f} | "
              f"{r['speed_ratio']:.2f} | {r['timing']} |")
    for name, err in IMPORT_ERRORS.items():
        print(f"baseline {name} not importable: {err}")
    swept = sweep(args.tokens) if args.sweep or args.sweep_only else None
    if args.out:
        write_evidence(args.out, {"timing": TIMING, "tree_width": tree_width(), "rows": table, "baseline_import_errors": IMPORT_ERRORS,
                                  "sweep": swept}, prov)


if __name__ == "__main__":
    main()
