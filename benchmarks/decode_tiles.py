"""Decode tiles: the fixed tiles against the tiles ``matmul.decode_tile`` picks from the geometry
(``matmul.DECODE_TILES`` off, then on), alternated in one run, for the GEMMs of a Qwen3-MoE layer at
decode row counts, with the weights read from HBM; and whether both compute the same bits.

    PYTHONPATH=.:$PYTHONPATH python benchmarks/decode_tiles.py [--geometries a3b48 a22b_h200 h1536e256k6] \\
        [--rows 1 4 16 64 256] [--gemms qkv o_proj router gate_up down o_proj_tree down_tree] [--rounds 6] [--out X.json]

Each GEMM as the rollout calls it: qkv, o_proj (tree width 1) and router through ``matmul`` with
their roles ("plain", "row", "router"); gate/up and the flat down projection (fp32 out) through
``grouped_matmul`` with the call's tokens and slots, on T tokens routed uniformly at random
(``moe.align``); the segment-tree contract's (8 segments) o_proj through ``split_matmul`` as
``tree_reduce.row_linear`` calls it at TP 1 (bf16 out) and its down projection through
``grouped_matmul(segments=8, tree=True)`` (``seg_tree``, fp32 out). A call runs over enough copies of its weights (``copies``) that the bytes it reads
are >= 4 x the L2, so every copy comes from HBM as in the layer stack. Each variant is one CUDA
graph of the copies, captured with DECODE_TILES off ("old") or on ("new"); the two are replayed
in alternation (old, new, new, old, ...) for ``--rounds`` rounds, so drifts of clock and heat fall
on both. A row: the median per-call time of each, the weight bytes per second (the touched
experts' for the MoE), both tiles, and ``torch.equal(new, old)`` on every real row.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import captured, replay_ms, reps_for  # noqa: E402

GEMMS = ("qkv", "o_proj", "router", "gate_up", "down", "o_proj_tree", "down_tree")
TREE_SEGMENTS = 8  # the segment-tree contract's width at TP 1
MAX_COPY_BYTES = 24 << 30  # the weight copies of one GEMM at most (HBM)


def layer_gemms(s: dict) -> dict:
    """name -> (role, N, K) of a layer's GEMMs; gate_up and down are per expert."""
    h, d = s["hidden_size"], s["head_dim"]
    hq, hkv, e, i = s["num_attention_heads"], s["num_key_value_heads"], s["num_experts"], s["moe_intermediate_size"]
    return {"qkv": ("plain", (hq + 2 * hkv) * d, h), "o_proj": ("row", h, hq * d), "router": ("router", e, h),
            "gate_up": ("plain", 2 * i, h), "down": ("down", h, i), "o_proj_tree": ("split", h, hq * d),
            "down_tree": ("seg_tree", h, i)}


@contextlib.contextmanager
def decode_tiles(on: bool):
    import true_on_policy.kernels.matmul as mm

    before = mm.DECODE_TILES
    mm.DECODE_TILES = on
    try:
        yield
    finally:
        mm.DECODE_TILES = before


def _tile(cfg) -> str:
    """A tile, or (split_matmul) a (tile, segments per plane) pair."""
    cfg, pp = cfg if isinstance(cfg, (tuple, list)) else (cfg, None)
    bk = cfg.get("BLOCK_K", cfg.get("BK"))
    return (f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']}x{bk} w{cfg['num_warps']} s{cfg['num_stages']}"
            + (f" pp{pp}" if pp else ""))


def case(s: dict, gemm: str, t: int, g, l2: int):
    """(variant(decode) -> fn, mask of real rows or None, bytes one call reads, tiles(decode), copies)."""
    import true_on_policy.kernels.matmul as mm
    from true_on_policy.kernels.moe import align

    role, n, k = layer_gemms(s)[gemm]
    e, top_k = s["num_experts"], s["num_experts_per_tok"]
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def copies_of(shape, touched_bytes):
        full = 2 * int(torch.Size(shape).numel())
        c = max(2, min(-(-4 * l2 // touched_bytes), MAX_COPY_BYTES // full))
        return [(torch.randn(*shape, device="cuda", generator=g) * 0.03).bfloat16() for _ in range(c)]

    if gemm == "o_proj_tree":
        ws = copies_of((n, k), 2 * n * k)
        x = torch.randn(t, k, device="cuda", generator=g).bfloat16()

        variant = _over_copies(ws, lambda w: mm.split_matmul(x, w, TREE_SEGMENTS))
        return (variant, None, 2 * n * k,
                lambda d: _with(d, lambda: mm.split_tiles(t, n, k, TREE_SEGMENTS, sms)), len(ws))
    if gemm in ("qkv", "o_proj", "router"):
        ws = copies_of((n, k), 2 * n * k)
        x = torch.randn(t, k, device="cuda", generator=g).bfloat16()

        variant = _over_copies(ws, lambda w: mm.matmul(x, w, role=role))
        return variant, None, 2 * n * k, lambda d: _with(d, lambda: mm.tma_tiles(role, t, n, k, sms)), len(ws)
    ids = torch.rand(t, e, device="cuda", generator=g).argsort(dim=1)[:, :top_k].int()
    rows, be, _, own = align(ids, 0, e)
    table = rows if gemm == "gate_up" else own
    segments = TREE_SEGMENTS if gemm == "down_tree" else 1
    touched = int(torch.unique(ids).numel()) * n * k * 2
    ws = copies_of((e, n, k), top_k * n * k * 2)  # at one token: top_k experts touched
    x = torch.randn(t if gemm == "gate_up" else table.shape[0], k, device="cuda", generator=g).bfloat16()
    dtype = torch.bfloat16 if gemm == "gate_up" else torch.float32
    mask = (be >= 0).repeat_interleave(mm.ALIGN) & (table >= 0)

    variant = _over_copies(ws, lambda w: mm.grouped_matmul(x, w, table, be, dtype, segments, tree=segments > 1,
                                                          role="plain" if segments > 1 else role, tokens=t,
                                                          slots=t * top_k))
    if segments > 1:
        tiles = lambda d: _with(d, lambda: tree_tile(t, t * top_k, e, n, k, segments, sms))  # noqa: E731
    else:
        tiles = lambda d: _with(d, lambda: mm.grouped_tiles(role, t, t * top_k, e, n, k, sms))  # noqa: E731
    return variant, mask, touched, tiles, len(ws)


def tree_tile(t: int, slots: int, e: int, n: int, k: int, segments: int, sms: int) -> dict:
    """The tile the grouped tree GEMM runs: ``seg_tree``'s (``seg_tiles``) where its stages fit, else the flat
    loop's."""
    import true_on_policy.kernels.matmul as mm

    if mm.seg_path(k, segments) or mm.wide_decode(t, slots, e, k, segments):
        return mm.seg_tiles(t, slots, e, n, k, segments, sms)
    return mm._tiles(segments, True, k)


def _over_copies(ws, call):
    """variant(decode) -> a function that runs ``call(w)`` on every weight copy with the decode tiles
    on or off and returns the last output (what a graph of it captures)."""
    def variant(decode):
        def run():
            with decode_tiles(decode):
                for w in ws:
                    y = call(w)
            return y
        return run
    return variant


def _with(decode, fn):
    with decode_tiles(decode):
        return fn()


def run(geometries, rows, gemms, rounds):
    from geometries import spec

    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 50 << 20) or (50 << 20)
    g = torch.Generator(device="cuda").manual_seed(0)
    out = []
    print("| geometry | gemm | rows | old tile | new tile | copies | old us | new us | new/old | old GB/s | new GB/s | "
          "same bits |\n|---|---|---:|---|---|---:|---:|---:|---:|---:|---:|---|", flush=True)
    for name in geometries:
        s = spec(name)
        for gemm in gemms:
            for t in rows:
                variant, mask, nbytes, tiles, copies = case(s, gemm, t, g, l2)
                graphs = {d: captured(variant(d)) for d in (False, True)}
                for graph, _ in graphs.values():
                    graph.replay()
                torch.cuda.synchronize()
                old, new = (graphs[d][1] for d in (False, True))
                same = bool(torch.equal(new[mask], old[mask]) if mask is not None else torch.equal(new, old))
                reps = reps_for(graphs[False][0])
                times = {False: [], True: []}
                for r in range(rounds):
                    for d in ((False, True) if r % 2 == 0 else (True, False)):
                        times[d].append(replay_ms(graphs[d][0], reps) / copies)
                med = {d: statistics.median(v) for d, v in times.items()}
                row = {"geometry": name, "gemm": gemm, "rows": t, "old_tile": tiles(False), "new_tile": tiles(True),
                       "copies": copies, "bytes_per_call": nbytes, "old_ms": med[False], "new_ms": med[True],
                       "new_over_old": med[True] / med[False], "old_gbps": nbytes / med[False] / 1e6,
                       "new_gbps": nbytes / med[True] / 1e6, "old_ms_rounds": times[False],
                       "new_ms_rounds": times[True], "same_bits": same}
                out.append(row)
                print(f"| {name} | {gemm} | {t} | {_tile(row['old_tile'])} | {_tile(row['new_tile'])} | {copies} | "
                      f"{med[False] * 1e3:.2f} | {med[True] * 1e3:.2f} | {row['new_over_old']:.3f} | "
                      f"{row['old_gbps']:.0f} | {row['new_gbps']:.0f} | {same} |", flush=True)
                del graphs, variant, old, new
                torch.cuda.empty_cache()
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--geometries", nargs="+", default=["a3b48", "a22b_h200", "h1536e256k6"])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    ap.add_argument("--gemms", nargs="+", choices=GEMMS, default=list(GEMMS))
    ap.add_argument("--rounds", type=int, default=6, help="alternations of old and new per row (median)")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    from true_on_policy.harness.provenance import provenance, write_evidence

    prov = provenance(None if argv is None else ["python", "benchmarks/decode_tiles.py", *argv])
    rows = run(a.geometries, a.rows, a.gemms, a.rounds)
    bad = [r for r in rows if not r["same_bits"]]
    if a.out:
        write_evidence(a.out, {"rounds": a.rounds, "sms": torch.cuda.get_device_properties(0).multi_processor_count,
                               "all_same_bits": not bad, "rows": rows}, prov)
    if bad:
        raise SystemExit(f"{len(bad)} rows where the new tiles' bits differ from the old: "
                         + ", ".join(f"{r['geometry']} {r['gemm']} rows={r['rows']}" for r in bad))


if __name__ == "__main__":
    main()
