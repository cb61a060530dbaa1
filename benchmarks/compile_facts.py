"""What ptxas makes of the segment-tree GEMM (``kernels/seg_tree.py``) for an H100/H200 (sm_90a), on any
machine: no GPU is needed, only Triton's bundled ptxas and nvdisasm.

    python benchmarks/compile_facts.py [--geometries a3b48 ...] [--tiles wide] [--out evidence/compile-seg-tree.json]

For each geometry's MoE down projection under v1 (8 segments of moe_intermediate / 8 columns) and each
tile of ``kernels.matmul.candidate_tiles("seg_tree")`` that stages a segment in shared memory, it compiles
the expert-grouped kernel twice, the weights by pointer loads and by tensor descriptor (``tma``), with the
specialisation the JIT gives at launch (16-divisible pointers and sizes, unit strides as constants; without
it the K loop is not pipelined), and records registers per thread, spilled bytes, shared memory and the
count of MMA instructions (HMMA: mma.sync, HGMMA: wgmma) and of cp.async copies (LDGSTS) in the SASS.
Registers bound how many fp32 partials a tile keeps live; a spill sends them through local memory.
``--tiles wide`` compiles instead prefill tiles beyond the candidates, in 8 and 16 warps (``WIDE``): more warps
share a tile's partials, but a program of 16 warps has at most 128 registers a thread.
Speed is measured on the GPU (``regenerate_evidence.sh segtma``), not here. ``grouped_tma_kernel`` compiles the
grouped TMA GEMM the same way (tests/cpu/test_compile_facts.py compares its programs' orders).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


# prefill tiles beyond the candidates (4 warps, at most 64 x 128): 64 or 128 rows (at most an expert group's
# matmul.ALIGN) by 128 or 256 columns in 8 or 16 warps, the stages that fit
WIDE = [dict(BLOCK_M=64, BLOCK_N=128, BK=64, num_warps=8, num_stages=3),
        dict(BLOCK_M=128, BLOCK_N=128, BK=64, num_warps=8, num_stages=2),
        dict(BLOCK_M=128, BLOCK_N=128, BK=64, num_warps=16, num_stages=2),
        dict(BLOCK_M=128, BLOCK_N=128, BK=32, num_warps=16, num_stages=3),
        dict(BLOCK_M=64, BLOCK_N=256, BK=64, num_warps=16, num_stages=2),
        dict(BLOCK_M=128, BLOCK_N=256, BK=64, num_warps=16, num_stages=2)]


def compile_sm90(fn, types: dict, consts: dict, div16=(), warps=4, stages=3):
    """``fn`` compiled for sm_90a: ``types`` the runtime arguments' Triton types, ``consts`` the constexprs
    (and the ints the JIT makes constants), ``div16`` the arguments it marks divisible by 16."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {**types, **{k: "constexpr" for k in consts}}
    sig = {n: sig[n] for n in fn.arg_names if n in sig}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in div16}
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})


def facts(kernel) -> dict:
    import triton

    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as d:
        ptx, cubin = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        report = subprocess.run([os.path.join(tools, "ptxas"), "-v", "-arch=sm_90a", ptx, "-o", os.path.join(d, "k.o")],
                                capture_output=True, text=True, check=True).stderr
        with open(cubin, "wb") as f:
            f.write(kernel.asm["cubin"])
        sass = subprocess.run([os.path.join(tools, "nvdisasm"), cubin], capture_output=True, text=True,
                              check=True).stdout
    ops = Counter(o.split(".")[0] for o in re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", sass, re.M))
    spill = re.search(r"(\d+) bytes spill stores", report)
    return {"registers": int(re.search(r"Used (\d+) registers", report).group(1)),
            "spill_store_bytes": int(spill.group(1)) if spill else 0, "shared_bytes": kernel.metadata.shared,
            **{op: ops.get(op, 0) for op in ("HMMA", "HGMMA", "LDGSTS", "FSEL", "FADD")}}


def seg_tree_kernel(cfg: dict, seg: int, segments: int, subtiles: int, tma: bool, group: int = 0):
    """``group``: the kernel's GROUP (programs in groups of M blocks, ``matmul.program_tile``; 0 the 2-D grid)."""
    from true_on_policy.kernels import seg_tree

    nch, tail = seg_tree.chunks_of(seg, cfg["BK"])
    types = {"A": "*bf16", "C": "*fp32", "A_IDX": "*i32", "BLOCK_EXPERT": "*i32", "M": "i32", "N": "i32", "SEG": "i32",
             "stride_am": "i32", "stride_be": "i32", "stride_bn": "i32", "stride_cm": "i32"}
    consts = dict(stride_ak=1, stride_bk=1, stride_cn=1, HAS_IDX=True, GROUPED=True, SEGMENTS=segments,
                  BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BK=cfg["BK"], NCH=nch, BKT=tail, DOT_F32=False,
                  SUBTILES=subtiles, TMA=tma, GROUP=group)
    div16 = ["A", "C", "A_IDX", "BLOCK_EXPERT", "N", "SEG", "stride_am", "stride_be", "stride_bn", "stride_cm"]
    if tma:
        types["B"] = f"tensordesc<bf16[{cfg['BLOCK_N']}, {cfg['BK']}]>"
        types["BT"] = f"tensordesc<bf16[{cfg['BLOCK_N']}, {tail or cfg['BK']}]>"
    else:
        types["B"], consts["BT"] = "*bf16", None
        div16.append("B")
    return compile_sm90(seg_tree._seg_tree_kernel, types, consts, div16, cfg["num_warps"], cfg["num_stages"])


def seg_tree_smem_kernel(cfg: dict, seg: int, segments: int = 8, group: int = 0):
    """``seg_tree_smem._seg_tree_smem_kernel`` (Gluon: the tree's waiting partials in shared memory) for segments of
    ``seg`` columns, expert-grouped and gathered as the MoE's down projection launches it."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from true_on_policy.kernels import seg_tree_smem

    fn = seg_tree_smem._seg_tree_smem_kernel
    types = {"A": "*bf16", "B": "*bf16", "C": "*fp32", "A_IDX": "*i32", "BLOCK_EXPERT": "*i32", "M": "i32", "N": "i32",
             "SEG": "i32", "stride_am": "i32", "stride_be": "i32", "stride_bn": "i32", "stride_cm": "i32"}
    consts = dict(HAS_IDX=True, GROUPED=True, SEGMENTS=segments, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
                  BK=cfg["BK"], CPS=seg // cfg["BK"], STAGES=cfg["STAGES"], GROUP=group, num_warps=cfg["num_warps"],
                  PINGPONG=cfg.get("PINGPONG", False), TMA_B=cfg.get("TMA_B", False))
    div16 = ["A", "C", "A_IDX", "BLOCK_EXPERT", "N", "SEG", "stride_am", "stride_be", "stride_bn", "stride_cm"]
    if cfg.get("TMA_B"):
        types["B"] = f"tensordesc<bf16[{cfg['BLOCK_N']}, {cfg['BK']}],{seg_tree_smem.b_layout(cfg)!r}>"
    else:
        div16.append("B")
    sig = {**types, **{k: "constexpr" for k in consts}}
    sig = {n: sig[n] for n in fn.arg_names if n in sig}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in div16}
    return triton.compile(GluonASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": cfg["num_warps"]})


def grouped_tma_kernel(cfg: dict, n: int, k: int, out: str = "bf16", group: int = 0, subtiles: int = 1):
    """``grouped_tma._grouped_tma_kernel`` (the MoE's gate/up, ``out`` bf16, or flat down projection, fp32) for
    an [E, n, k] weight, specialised as at launch; ``group`` its GROUP (0: the 2-D grid)."""
    from true_on_policy.kernels import grouped_tma

    types = {"A": "*bf16", "b_desc": f"tensordesc<bf16[{cfg['BLOCK_N']}, {cfg['BLOCK_K']}]>", "C": f"*{out}",
             "A_IDX": "*i64", "BLOCK_EXPERT": "*i32", "M": "i32", "N": "i32", "K": "i32", "stride_am": "i32",
             "stride_cm": "i32"}
    consts = dict(stride_ak=1, stride_cn=1, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
                  DOT_F32=False, STEP=cfg["BLOCK_K"], SUBTILES=subtiles, GLU=False, SEGMENTS=1, GROUP=group)
    div16 = ["A", "C", "A_IDX", "BLOCK_EXPERT", "N", "K", "stride_am", "stride_cm"]
    return compile_sm90(grouped_tma._grouped_tma_kernel, types, consts, div16, cfg["num_warps"], cfg["num_stages"])


def main(argv=None) -> int:
    import geometries

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--geometries", nargs="+", default=list(geometries.SPACE), choices=list(geometries.SPACE))
    p.add_argument("--segments", type=int, default=8)
    p.add_argument("--tiles", choices=("candidates", "wide"), default="candidates",
                   help="the seg_tree candidate tiles (with and without the block loop), or WIDE (no block loop)")
    p.add_argument("--out", help="write the evidence here")
    a = p.parse_args(argv)
    from true_on_policy.kernels import matmul as mm
    from true_on_policy.kernels import seg_tree

    from true_on_policy.harness.provenance import provenance, write_evidence

    prov = provenance(None if argv is None else ["python", "benchmarks/compile_facts.py", *argv])
    rows = []
    for name in a.geometries:
        seg = geometries.SPACE[name]["moe_intermediate_size"] // a.segments
        for cfg in mm.candidate_tiles("seg_tree") if a.tiles == "candidates" else WIDE:
            if not (seg_tree.fits(seg, cfg["BK"]) and seg_tree.smem_ok(seg, cfg)):
                continue
            for sub in sorted({1, mm.ALIGN // cfg["BLOCK_M"]}) if a.tiles == "candidates" else [1]:
                row = {"geometry": name, "segment": seg, "segments": a.segments, "tile": dict(cfg), "subtiles": sub}
                for form in ("pointer", "tma"):
                    row[form] = facts(seg_tree_kernel(cfg, seg, a.segments, sub, form == "tma"))
                rows.append(row)
                print(f"{name} seg {seg} {cfg['BLOCK_M']}x{cfg['BLOCK_N']}x{cfg['BK']} w{cfg['num_warps']} "
                      f"s{cfg['num_stages']} sub {sub}: pointer {row['pointer']['registers']} regs "
                      f"{row['pointer']['spill_store_bytes']} B spilled; tma {row['tma']['registers']} regs "
                      f"{row['tma']['spill_store_bytes']} B spilled", flush=True)
    if a.out:
        write_evidence(a.out, {"target": "sm_90a", "kernel": "kernels.seg_tree._seg_tree_kernel (expert-grouped)",
                               "tiles": a.tiles, "rows": rows}, prov)
    return 0


if __name__ == "__main__":
    sys.exit(main())
