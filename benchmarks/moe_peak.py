"""The MoE block in one pass and in token chunks (``kernels.moe.token_chunk``), alternated in one run: the
activation memory each holds above its inputs and weights, its time, and whether the chunks give the one
pass's bits (``torch.equal``), at the layer shapes of the benchmark geometries and prefill chunk sizes.

    PYTHONPATH=.:$PYTHONPATH python benchmarks/moe_peak.py [--geometries a35b_h100 a22b_h100] \\
        [--tokens 4096 8192 16384] [--rounds 5] [--out X.json]

One case: one layer's router and experts with random bf16 weights and ``tokens`` random hidden rows, routed
to ``num_experts_per_tok`` experts each. "whole": the bound lifted (``MOE_DOWN_BYTES`` above any pass);
"chunked": the bound the server runs with (1/``MOE_DOWN_SHARE`` of this GPU's memory), which runs the tokens
whole where they fit it. A row: the chunk the bound gives, each variant's peak above its inputs
(``torch.cuda.max_memory_allocated``) and median time over ``--rounds`` rounds, chunked / whole, and the bits.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

GIB = 1 << 30


def _peak_and_ms(fn, *args) -> tuple[torch.Tensor, int, float]:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    y = fn(*args)
    end.record()
    torch.cuda.synchronize()
    return y, torch.cuda.max_memory_allocated() - base, start.elapsed_time(end)


def run(geometries, tokens, rounds):
    from geometries import spec
    from true_on_policy.kernels import moe as M

    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    print("| geometry | tokens | chunk | whole GiB | chunked GiB | whole ms | chunked ms | chunked / whole | bits |\n"
          "|---|---:|---:|---:|---:|---:|---:|---:|---|", flush=True)
    for name in geometries:
        s = spec(name)
        h, inter, e, k = s["hidden_size"], s["moe_intermediate_size"], s["num_experts"], s["num_experts_per_tok"]
        router = (torch.randn(e, h, device="cuda", generator=g) * 0.02).bfloat16()
        w13 = (torch.randn(e, 2 * inter, h, device="cuda", generator=g) * 0.02).bfloat16()
        w2 = (torch.randn(e, h, inter, device="cuda", generator=g) * 0.02).bfloat16()
        for t in tokens:
            x = torch.randn(t, h, device="cuda", generator=g).bfloat16()
            cap = M.down_cap(x)
            chunk = M.token_chunk(t, k, h, e, cap)
            variants = {"whole": 1 << 62, "chunked": None}
            peaks, times, outs = {v: [] for v in variants}, {v: [] for v in variants}, {}
            try:
                for r in range(rounds + 1):  # round 0 compiles and warms; not counted
                    for v in (variants if r % 2 else reversed(list(variants))):
                        M.MOE_DOWN_BYTES = variants[v]
                        y, peak, ms = _peak_and_ms(M.moe, x, router, w13, w2, k)
                        outs[v] = y
                        if r:
                            peaks[v].append(peak)
                            times[v].append(ms)
            finally:
                M.MOE_DOWN_BYTES = None
            same = torch.equal(outs["whole"], outs["chunked"])
            row = {"geometry": name, "tokens": t, "chunk": chunk, "top_k": k, "hidden": h, "experts": e,
                   "intermediate": inter, "cap_bytes": cap, "down_bytes_whole": M.down_bytes(t, k, h, e),
                   "peak_bytes": {v: max(p) for v, p in peaks.items()},
                   "ms": {v: statistics.median(x_) for v, x_ in times.items()},
                   "ms_rounds": times, "same_bits": same}
            row["chunked_over_whole"] = row["ms"]["chunked"] / row["ms"]["whole"]
            rows.append(row)
            print(f"| {name} | {t} | {chunk} | {row['peak_bytes']['whole'] / GIB:.2f} | "
                  f"{row['peak_bytes']['chunked'] / GIB:.2f} | {row['ms']['whole']:.2f} | {row['ms']['chunked']:.2f} | "
                  f"{row['chunked_over_whole']:.3f} | {'equal' if same else 'DIFFER'} |", flush=True)
            del x, outs
        del router, w13, w2
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--geometries", nargs="+", default=["a35b_h100", "a22b_h100"])
    p.add_argument("--tokens", nargs="+", type=int, default=[4096, 8192, 16384])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("moe_peak: needs a CUDA GPU", file=sys.stderr)
        return 2
    from true_on_policy.harness.provenance import provenance, write_evidence

    prov = provenance(None if argv is None else ["python", "benchmarks/moe_peak.py", *argv])
    rows = run(a.geometries, a.tokens, a.rounds)
    if a.out:
        write_evidence(a.out, {"rows": rows, "rounds": a.rounds, "alternated": True,
                               "all_same_bits": all(r["same_bits"] for r in rows)}, prov)
    return 0 if all(r["same_bits"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
