"""Decode attention: stock SGLang's Triton decode kernel against ours, with the fixed tile and every
candidate launch tile (``attention.candidate_tiles``), alternated in one run, at the head layouts of
the benchmark geometries and decode batches; and whether each candidate gives the fixed tile's bits.

    PYTHONPATH=.:$PYTHONPATH python benchmarks/attention_decode.py [--geometries a3b48 h1536e256k6 ...] \\
        [--batches 1 4 16 64 256] [--contexts 1024] [--rounds 6] [--stages 1 2 3] [--out X.json]

One case: ``batch`` sequences of ``context`` keys each in a shuffled paged pool (SGLang's
``req_to_token`` rows, read through ``kv_rows`` as the rollout does), one query each. Stock: SGLang
0.5.17's ``decode_attention_fwd`` with the split count its Triton backend computes for these lengths
(``get_num_kv_splits_triton``, at most 8 splits, the server's default) and its buffers. Ours: the
decode form bounded by a 40,960-token context (Qwen3-MoE's, the width SGLang gives
``req_to_token``), which lets a small batch split its segments; the fixed tile, then each candidate
with the split rule and without a split. Each variant is one CUDA graph of the call over enough
layers' K/V copies that they come from HBM; the graphs replay in a rotating order for ``--rounds``
rounds. A row: each variant's median time per layer, ours / stock, the fastest candidate that
gives the fixed tile's bits (``torch.equal`` of the outputs), and the candidates that do not.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import captured, replay_ms, reps_for  # noqa: E402

MAX_CTX = 40960  # Qwen3-MoE's context length: SGLang's req_to_token width, ours max_kv_len
STOCK_SPLITS = 8  # SGLang's --triton-attention-num-kv-splits default


def stock_call(q, kbs, vbs, req_to_token, seq_lens):
    """SGLang's decode over every K/V copy, with its backend's split count and buffers (None when
    SGLang's kernels are not importable)."""
    try:
        from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd
        from sglang.kernels.ops.attention.metadata import get_num_kv_splits_triton
    except Exception:  # noqa: BLE001  (reported as "n/a")
        return None
    b, hq, d = q.shape
    hkv = kbs[0].shape[1]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = torch.empty(b, dtype=torch.int32, device="cuda")
    get_num_kv_splits_triton[(1,)](splits, seq_lens, b, 1, hq, hkv, STOCK_SPLITS, sms,
                                   MAX_NUM_SEQ=max(256, 1 << (b - 1).bit_length()))
    indptr = torch.zeros(b + 1, dtype=torch.int32, device="cuda")
    indptr[1:] = torch.cumsum(seq_lens, 0)
    indices = torch.cat([req_to_token[i, :int(n)] for i, n in enumerate(seq_lens.tolist())])
    logits = torch.empty(b, hq, STOCK_SPLITS, d, dtype=torch.float32, device="cuda")
    lse = torch.empty(b, hq, STOCK_SPLITS, dtype=torch.float32, device="cuda")
    out = torch.empty_like(q)

    def run():
        for kb, vb in zip(kbs, vbs, strict=True):
            decode_attention_fwd(q, kb, vb, out, indptr, indices, logits, lse, splits, STOCK_SPLITS,
                                 1 / math.sqrt(d), 1.0, 1.0)
        return out
    return run, splits


def ours_call(q, kbs, vbs, req_to_token, seq_lens, tile):
    from true_on_policy.kernels.attention import attention

    rows = torch.arange(q.shape[0], device="cuda")  # int64, as SGLang's req_pool_indices
    out = torch.empty_like(q)

    def run():
        for kb, vb in zip(kbs, vbs, strict=True):
            attention(q, kb, vb, req_to_token, None, None, None, 1, kv_rows=rows, max_kv_len=MAX_CTX,
                      seq_lens=seq_lens, out=out, tile=tile)
        return out
    return run


def _us(med: dict, k: str) -> str:
    return f"{med[k] * 1e3:.1f}" if k in med else "n/a"


def _ratio(x) -> str:
    return f"{x:.2f}" if x is not None else "n/a"


def run(geometries, batches, contexts, rounds, stages=(1, 2, 3), done=None):
    from geometries import spec
    from true_on_policy.kernels.attention import candidate_tiles, tile_label

    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 50 << 20) or (50 << 20)
    g = torch.Generator(device="cuda").manual_seed(0)
    out = []
    print("| geometry | Hq/Hkv | context | batch | stock splits | stock us | fixed us | fixed / stock | fastest same-bits "
          "candidate | its us | its / stock | candidates differing |\n"
          "|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---|", flush=True)
    for name in geometries:
        s = spec(name)
        hq, hkv, d = s["num_attention_heads"], s["num_key_value_heads"], s["head_dim"]
        tiles = [t for t in candidate_tiles(hq // hkv)[1:] if t["num_stages"] in stages]  # [0]: "fixed"
        tiles += [dict(t, split=1) for t in tiles]
        for ctx in contexts:
            for b in batches:
                kv_bytes = 2 * b * ctx * hkv * d * 2
                copies = max(2, min(64, -(-4 * l2 // kv_bytes)))
                pool = b * ctx + 64
                kbs = [(torch.randn(pool, hkv, d, device="cuda", generator=g)).bfloat16() for _ in range(copies)]
                vbs = [(torch.randn(pool, hkv, d, device="cuda", generator=g)).bfloat16() for _ in range(copies)]
                req_to_token = torch.zeros(b, MAX_CTX, dtype=torch.int32, device="cuda")
                req_to_token[:, :ctx] = torch.randperm(pool, device="cuda", generator=g)[:b * ctx].int().view(b, ctx)
                q = torch.randn(b, hq, d, device="cuda", generator=g).bfloat16()
                seq_lens = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
                variants = {"fixed": ours_call(q, kbs, vbs, req_to_token, seq_lens, None)}
                stock = stock_call(q, kbs, vbs, req_to_token, seq_lens)
                if stock:
                    variants["stock"] = stock[0]
                for t in tiles:
                    variants[tile_label(t)] = ours_call(q, kbs, vbs, req_to_token, seq_lens, t)
                graphs = {}
                for k, fn in variants.items():
                    try:
                        graphs[k] = captured(fn)
                    except Exception as e:  # noqa: BLE001  (a candidate that does not compile is reported)
                        print(f"  {name} b{b}: {k} failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
                for graph, _ in graphs.values():
                    graph.replay()
                torch.cuda.synchronize()
                ref = graphs["fixed"][1]
                same = {k: bool(torch.equal(o, ref)) for k, (_, o) in graphs.items() if k != "stock"}
                reps = reps_for(graphs["fixed"][0])
                keys = list(graphs)
                times = {k: [] for k in keys}
                for r in range(rounds):
                    shift = r % len(keys)
                    for k in keys[shift:] + keys[:shift]:
                        times[k].append(replay_ms(graphs[k][0], reps) / copies)
                med = {k: statistics.median(v) for k, v in times.items()}
                st = med.get("stock")
                proven = [k for k in keys if k not in ("stock", "fixed") and same[k]]
                best = min(proven, key=med.__getitem__) if proven else None
                row = {"geometry": name, "heads": [hq, hkv], "context": ctx, "batch": b, "copies": copies,
                       "stock_splits": sorted(set(stock[1].tolist())) if stock else None,
                       "median_ms": med, "rounds_ms": times, "same_bits_as_fixed": same,
                       "fixed_over_stock": med["fixed"] / st if st else None, "best_candidate": best,
                       "best_over_stock": med[best] / st if best and st else None,
                       "best_over_fixed": med[best] / med["fixed"] if best else None,
                       "differing": [k for k, v in same.items() if not v]}
                out.append(row)
                if done:
                    done(out)
                print(f"| {name} | {hq}/{hkv} | {ctx} | {b} | {row['stock_splits']} | {_us(med, 'stock')} | "
                      f"{_us(med, 'fixed')} | {_ratio(row['fixed_over_stock'])} | {best or '-'} | "
                      f"{_us(med, best) if best else '-'} | {_ratio(row['best_over_stock'])} | "
                      f"{len(row['differing'])} |", flush=True)
                del graphs, variants, kbs, vbs, req_to_token
                torch.cuda.empty_cache()
    return out


def main(argv=None):
    from geometries import SPACE

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--geometries", nargs="+", default=list(SPACE))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024])
    ap.add_argument("--rounds", type=int, default=6, help="rotations of the variants per row (median)")
    ap.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3], help="the candidates' stages to time")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    from true_on_policy.harness.provenance import provenance, write_evidence

    prov = provenance(None if argv is None else ["python", "benchmarks/attention_decode.py", *argv])
    def write(rows, complete=False):  # after every row: a run cut short keeps the rows it timed
        if args.out:
            write_evidence(args.out, {"timing": "cuda graphs of the call over HBM-resident K/V copies, rotated",
                                      "max_kv_len": MAX_CTX, "stock_max_splits": STOCK_SPLITS, "complete": complete,
                                      "rows": rows}, prov)

    write(run(args.geometries, args.batches, args.contexts, args.rounds, args.stages, done=write), complete=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
