"""Prefill attention: stock SGLang's Triton extend kernel against ours, the fixed tile in its nested
loop and in the flat loop (TRUE_ON_POLICY_PREFILL_LOOP=flat), alternated in one run, at the head
layouts of the benchmark geometries and prefill shapes; and whether the flat loop gives the nested
loop's bits.

    PYTHONPATH=.:$PYTHONPATH python benchmarks/attention_prefill.py [--geometries a3b48 h1536e256k6 ...] \\
        [--shapes 16:256 4:1024 1:4096 1:4096:4096] [--rounds 5] [--tiles fixed|all] [--out X.json]

A shape ``B:NEW[:PREFIX]``: B sequences of NEW new tokens each after a cached prefix of PREFIX
tokens (0 when left out), their K/V at shuffled slots of a paged pool read through SGLang's
``req_to_token`` rows, as the server's extend runs. ``16:256`` is ``plain``'s prefill (prompts of
64-512 tokens, 16 to a chunk of 4,096), ``1:4096:4096`` a chunked prefill's second chunk. Stock:
SGLang 0.5.17's ``extend_attention_fwd`` (causal, the prefix from the pool, the new tokens' K/V
contiguous, as its Triton backend calls it). Ours: ``kernels.attention.attention`` with the server's
40,960-token ``max_kv_len``. ``--tiles all`` adds every candidate tile in both loops. Each variant is
one CUDA graph of the call, the graphs replayed in a rotating order for ``--rounds`` rounds. A row:
each variant's median ms, ours / stock, flat / nested, and which variants differ from the nested
loop's bits (``torch.equal``).
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

MAX_CTX = 40960  # SGLang's req_to_token width for Qwen3-MoE: ours max_kv_len
DEFAULT_SHAPES = ["16:256", "4:1024", "1:4096", "1:4096:4096"]


def parse_shape(text: str) -> tuple[int, int, int]:
    """``B:NEW[:PREFIX]`` -> (B, NEW, PREFIX); ValueError naming the shape otherwise."""
    parts = text.split(":")
    try:
        b, new, pre = (int(p) for p in (parts + ["0"])[:3]) if len(parts) in (2, 3) else (0, 0, 0)
    except ValueError:
        b = new = pre = 0
    if b < 1 or new < 1 or pre < 0 or pre + new > MAX_CTX:
        raise ValueError(f"shape {text!r}: B:NEW[:PREFIX] with B, NEW >= 1, PREFIX >= 0 and PREFIX + NEW <= {MAX_CTX}")
    return b, new, pre


def layout(b: int, new: int, pre: int, hkv: int, d: int, gen):
    """A paged pool holding b sequences of pre + new keys at shuffled slots, their req_to_token rows,
    and the extend's per-sequence starts, lengths and prefix lengths."""
    n = pre + new
    pool = b * n + 64
    kb = torch.randn(pool, hkv, d, device="cuda", generator=gen).bfloat16()
    vb = torch.randn(pool, hkv, d, device="cuda", generator=gen).bfloat16()
    req_to_token = torch.zeros(b, MAX_CTX, dtype=torch.int32, device="cuda")
    req_to_token[:, :n] = torch.randperm(pool, device="cuda", generator=gen)[:b * n].int().view(b, n)
    i32 = dict(dtype=torch.int32, device="cuda")
    starts = torch.arange(b, **i32) * new
    return kb, vb, req_to_token, starts, torch.full((b,), new, **i32), torch.full((b,), pre, **i32)


def stock_call(q, kb, vb, req_to_token, b, new, pre):
    """SGLang's extend attention as its Triton backend runs it (None when its kernels do not import)."""
    try:
        from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd
    except Exception:  # noqa: BLE001  (reported as "n/a")
        return None
    d = q.shape[2]
    i32 = dict(dtype=torch.int32, device="cuda")
    new_slots = req_to_token[:, pre:pre + new].reshape(-1).long()
    k_ext, v_ext = kb[new_slots].contiguous(), vb[new_slots].contiguous()
    qo_indptr = torch.arange(b + 1, **i32) * new
    kv_indptr = torch.arange(b + 1, **i32) * pre
    kv_indices = req_to_token[:, :pre].reshape(-1).contiguous()
    out = torch.empty_like(q)

    def run():
        extend_attention_fwd(q, k_ext, v_ext, out, kb, vb, qo_indptr, kv_indptr, kv_indices, None, True, None, new,
                             1.0, 1.0, sm_scale=1 / math.sqrt(d))
        return out
    return run


def ours_call(q, kb, vb, req_to_token, starts, lens, pre, new, tile):
    from true_on_policy.kernels.attention import attention

    rows = torch.arange(lens.shape[0], device="cuda")  # int64, as SGLang's req_pool_indices
    out = torch.empty_like(q)

    def run():
        return attention(q, kb, vb, req_to_token, starts, lens, pre, new, kv_rows=rows, max_kv_len=MAX_CTX,
                         out=out, tile=tile)
    return run


def _ratio(a, b) -> float | None:
    return a / b if a is not None and b else None


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.2f}" if x < 10 else f"{x:.1f}"


def run(geometries, shapes, rounds, all_tiles=False, done=None):
    from geometries import spec
    from true_on_policy.kernels.attention import candidate_tiles, tile_label

    gen = torch.Generator(device="cuda").manual_seed(0)
    out = []
    print("| geometry | Hq/Hkv | shape | stock ms | nested ms | flat ms | nested / stock | flat / stock | flat / nested "
          "| differing |\n|---|---|---|---:|---:|---:|---:|---:|---:|---|", flush=True)
    for name in geometries:
        s = spec(name)
        hq, hkv, d = s["num_attention_heads"], s["num_key_value_heads"], s["head_dim"]
        tiles = {"nested": None, "flat": {"loop": "flat"}}
        if all_tiles:
            tiles.update({tile_label(t): t for t in candidate_tiles(hq // hkv)[1:]})
        for text in shapes:
            b, new, pre = parse_shape(text)
            kb, vb, req_to_token, starts, lens, pres = layout(b, new, pre, hkv, d, gen)
            q = torch.randn(b * new, hq, d, device="cuda", generator=gen).bfloat16()
            variants = {k: ours_call(q, kb, vb, req_to_token, starts, lens, pres, new, t) for k, t in tiles.items()}
            stock = stock_call(q, kb, vb, req_to_token, b, new, pre)
            if stock:
                variants["stock"] = stock
            graphs = {}
            for k, fn in variants.items():
                try:
                    graphs[k] = captured(fn)
                except Exception as e:  # noqa: BLE001  (a variant that does not run is reported)
                    print(f"  {name} {text}: {k} failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
            for graph, _ in graphs.values():
                graph.replay()
            torch.cuda.synchronize()
            ref = graphs["nested"][1]
            same = {k: bool(torch.equal(o, ref)) for k, (_, o) in graphs.items() if k != "stock"}
            reps = reps_for(graphs["nested"][0])
            keys = list(graphs)
            times = {k: [] for k in keys}
            for r in range(rounds):
                shift = r % len(keys)
                for k in keys[shift:] + keys[:shift]:
                    times[k].append(replay_ms(graphs[k][0], reps))
            med = {k: statistics.median(v) for k, v in times.items()}
            st = med.get("stock")
            row = {"geometry": name, "heads": [hq, hkv], "shape": text, "sequences": b, "new_tokens": new,
                   "prefix": pre, "median_ms": med, "rounds_ms": times, "same_bits_as_nested": same,
                   "nested_over_stock": _ratio(med.get("nested"), st), "flat_over_stock": _ratio(med.get("flat"), st),
                   "flat_over_nested": _ratio(med.get("flat"), med.get("nested")),
                   "differing": [k for k, v in same.items() if not v]}
            out.append(row)
            if done:
                done(out)
            print(f"| {name} | {hq}/{hkv} | {text} | {_fmt(st)} | {_fmt(med.get('nested'))} | "
                  f"{_fmt(med.get('flat'))} | {_fmt(row['nested_over_stock'])} | {_fmt(row['flat_over_stock'])} | "
                  f"{_fmt(row['flat_over_nested'])} | {', '.join(row['differing']) or '-'} |", flush=True)
            del graphs, variants, kb, vb, req_to_token
            torch.cuda.empty_cache()
    return out


def main(argv=None):
    from geometries import SPACE

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--geometries", nargs="+", default=list(SPACE), choices=list(SPACE))
    ap.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES, help="B:NEW[:PREFIX] each")
    ap.add_argument("--rounds", type=int, default=5, help="rotations of the variants per row (median)")
    ap.add_argument("--tiles", choices=["fixed", "all"], default="fixed",
                    help="fixed: the fixed tile, nested and flat; all: every candidate tile too")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    bad = []
    for text in args.shapes:
        try:
            parse_shape(text)
        except ValueError as e:
            bad.append(str(e))
    if bad:
        ap.error("; ".join(bad))
    from true_on_policy.harness.provenance import provenance, write_evidence

    prov = provenance(None if argv is None else ["python", "benchmarks/attention_prefill.py", *argv])

    def write(rows, complete=False):  # after every row: a run cut short keeps the rows it timed
        if args.out:
            write_evidence(args.out, {"timing": "cuda graphs of the call, rotated", "max_kv_len": MAX_CTX,
                                      "complete": complete, "rows": rows}, prov)

    write(run(args.geometries, args.shapes, args.rounds, args.tiles == "all", done=write), complete=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
