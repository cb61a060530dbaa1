"""Tile candidates for the MoE GEMMs at Qwen3-30B-A3B shapes: the down-projection (the grouped
8-segment tree GEMM) and the gate/up projection (the plain grouped GEMM): time of each candidate
and whether it computes the current tiles' bits.

    PYTHONPATH=.:$PYTHONPATH python benchmarks/tree_sweep.py [--tokens 1 64 256 4096] [--gemms down gate_up] [--out X.json]

Inputs as the rollout sees them: random routing of T tokens over 128 experts, top-8, through
``moe.align``; h [T*8 padded, 768] bf16, w2 [128, 2048, 768]. Each row: candidate tiles (ROW, or
ROW_FLAT-form tiles with ``N_GROUP`` column tiles per program), median ms of CUDA-graph replays,
the weight bytes of the experts that got a row over that time (GB/s; the H200's HBM is ~4.3
TB/s), and ``torch.equal`` with the first candidate's output on every real row (down: ROW; gate/up:
COLUMN, the tiles it ran with before). Gate/up: x [T, 2048], w13 [128, 1536, 2048]. Speed only
decides a role's tiles when the bits are the same.
"""

from __future__ import annotations

import argparse

import torch
import triton

E, K_TOP, H, INTER = 128, 8, 2048, 768
CANDIDATES = [dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=4),
              dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=6),
              dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=6, N_GROUP=2),
              dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=6, N_GROUP=4),
              dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=6, N_GROUP=4),
              dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=4),
              dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=4),
              dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=32, num_warps=4, num_stages=4),
              dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=4, N_GROUP=4),
              dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=32, num_warps=8, num_stages=3),
              dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=6, N_GROUP=4),
              dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=32, num_warps=2, num_stages=4, N_GROUP=4),
              dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=4, N_GROUP=8),
              dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=4, N_GROUP=4),
              dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=2, num_stages=6, N_GROUP=4)]
# gate/up: (tiles, flat). Flat (one K loop without masks, N_GROUP column tiles per program) needs
# BLOCK_K | 2048; the non-flat form is the kernel COLUMN runs today.
UP_CANDIDATES = [(dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4), False),
                 (dict(BLOCK_M=32, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4), False),
                 (dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4), False),
                 (dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4), False),
                 (dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=5, N_GROUP=4), True),
                 (dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4, N_GROUP=4), True),
                 (dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4, N_GROUP=2), True),
                 (dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=5, N_GROUP=4), True),
                 (dict(BLOCK_M=32, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4, N_GROUP=2), True),
                 (dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4, N_GROUP=4), True),
                 (dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4, N_GROUP=2), True),
                 (dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4), True)]


def _tag(name, cfg):
    return f"{name} " + "x".join(str(cfg[a]) for a in ("BLOCK_M", "BLOCK_N", "BLOCK_K")) + \
        f" w{cfg['num_warps']} s{cfg['num_stages']} g{cfg.get('N_GROUP', 1)}"


def run(tokens, gemms=("down", "gate_up")):
    import true_on_policy.kernels.matmul as mm
    from true_on_policy.kernels.moe import align

    g = torch.Generator(device="cuda").manual_seed(0)
    w2 = (torch.randn(E, H, INTER, device="cuda", generator=g) * 0.03).bfloat16()
    w13 = (torch.randn(E, 2 * INTER, H, device="cuda", generator=g) * 0.03).bfloat16()
    rows_out = []
    print("| gemm | tokens | tiles | ms | GB/s (touched experts) | bits == first |\n|---|---:|---|---:|---:|---|")
    for t in tokens:
        ids = torch.rand(t, E, device="cuda", generator=g).argsort(dim=1)[:, :K_TOP].int()
        rows, be, _, own = align(ids, 0, E)
        x = (torch.randn(t, H, device="cuda", generator=g)).bfloat16()
        h = (torch.randn(rows.shape[0], INTER, device="cuda", generator=g)).bfloat16()
        used = (be >= 0).repeat_interleave(mm.ALIGN)  # rows of used blocks; others are undefined
        real = {"down": used & (own >= 0), "gate_up": used & (rows >= 0)}
        n_touched = int(torch.unique(ids).numel())
        for gemm in gemms:
            if gemm == "down":
                cands = [("ROW", mm.ROW, False)] + [("flat", c, True) for c in CANDIDATES]
                a, w, a_idx, n, _k, seg, segments, touched = h, w2, own, H, INTER, INTER // 8, 8, n_touched * H * INTER * 2
            else:
                cands = [("COLUMN", mm.COLUMN, False)] + [("flat" if f else "plain", c, f) for c, f in UP_CANDIDATES]
                a, w, a_idx, n, _k, seg, segments, touched = x, w13, rows, 2 * INTER, H, H, 1, n_touched * 2 * INTER * H * 2
            ref = None
            for name, cfg, flat in cands:
                if mm.ALIGN % cfg["BLOCK_M"] or (flat and seg % cfg["BLOCK_K"]):
                    continue
                per = mm.ALIGN // cfg["BLOCK_M"]
                bexp = be[:, None].expand(-1, per).reshape(-1) if per > 1 else be
                out = torch.empty(rows.shape[0], n, dtype=torch.float32 if gemm == "down" else torch.bfloat16,
                                  device="cuda")

                def launch(cfg=cfg, flat=flat, bexp=bexp, out=out, a=a, w=w, a_idx=a_idx, n=n, seg=seg,
                           segments=segments, rows=rows):
                    grid = (triton.cdiv(rows.shape[0], cfg["BLOCK_M"]),
                            triton.cdiv(n, cfg["BLOCK_N"] * cfg.get("N_GROUP", 1)), 1)
                    mm._matmul_kernel[grid](a, w, out, a_idx, bexp, rows.shape[0], n, seg, a.stride(0), a.stride(1),
                                            w.stride(0), w.stride(1), w.stride(2), out.stride(0), out.stride(1), 0,
                                            HAS_IDX=True, GROUPED=True, SEGMENTS=segments, SPLIT=False,
                                            DOT_F32=False, FLAT=flat,
                                            **{key: v for key, v in cfg.items() if key != "FLAT"})
                try:
                    launch()
                    with torch.cuda.stream(torch.cuda.Stream()):
                        ms = triton.testing.do_bench_cudagraph(launch, rep=100, return_mode="median")
                except Exception as e:  # noqa: BLE001  (a candidate that does not compile or fit is reported)
                    print(f"| {gemm} | {t} | {_tag(name, cfg)} | failed: {type(e).__name__}: {str(e)[:80]} | | |")
                    continue
                got = out[real[gemm]].clone()
                ref = got if ref is None else ref
                same = bool(torch.equal(got, ref))
                tag = _tag(name, cfg)
                print(f"| {gemm} | {t} | {tag} | {ms:.4f} | {touched / ms / 1e6:.0f} | {same} |")
                rows_out.append({"gemm": gemm, "tokens": t, "tiles": tag, "ms": ms,
                                 "gbps_touched": touched / ms / 1e6, "same_bits": same})
            torch.cuda.empty_cache()
    return rows_out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 256, 4096])
    ap.add_argument("--gemms", nargs="+", choices=("down", "gate_up"), default=["down", "gate_up"])
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    from true_on_policy.harness.provenance import provenance, write_evidence

    prov = provenance(None if argv is None else ["python", "benchmarks/tree_sweep.py", *argv])
    rows = run(a.tokens, a.gemms)
    if a.out:
        write_evidence(a.out, {"rows": rows}, prov)


if __name__ == "__main__":
    main()
