"""Decode attention at the benchmark geometries' head layouts: stock SGLang's Triton decode kernel and
ours, each against a plain torch reference, per query head. Where a stock ratio is taken against
a kernel that computes something else, the ratio times a different computation; this says where.

    PYTHONPATH=.:$PYTHONPATH python benchmarks/stock_decode_groups.py [--geometries a3b48 h3072e64k4 ...] \\
        [--context 40] [--out evidence/stock-decode-groups.json]

On a machine without CUDA both kernels run in Triton's interpreter (set before Triton is imported),
so the CPU answers the question too. One sequence of ``--context`` keys, one query; fp32 inputs for
stock (what is checked is which KV head a query head reads, not rounding) and bf16 for ours (the
dtype it serves), each against the reference at its own inputs. A head is "off" when its largest
error exceeds ``--tol``; the reference is ``kernels.attention.attention_reference``: softmax(q k^T /
sqrt(d)) v in fp32, each query head reading KV head ``h // (Hq / Hkv)``, rounded to the inputs' dtype.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _interpret_without_cuda() -> bool:
    """Triton's interpreter when this machine has no CUDA GPU; must run before Triton is imported."""
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
        return True
    return False


def reference(q, k, v):
    """[Hq, D] from q [Hq, D] and k, v [L, Hkv, D]: ``attention_reference`` (fp32, rounded to q's dtype)
    for the one query at the last position."""
    import torch
    from true_on_policy.kernels.attention import attention_reference

    n, dev = k.shape[0], q.device
    one = torch.ones(1, dtype=torch.int32, device=dev)
    return attention_reference(q[None], k, v, torch.arange(n, dtype=torch.int32, device=dev)[None], one - 1, one,
                               one * (n - 1))[0]


def stock(q, k, v, splits: int = 2):
    """SGLang 0.5.17's ``decode_attention_fwd`` for one sequence holding every key of k, v."""
    import torch
    from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd

    hq, d = q.shape
    n = k.shape[0]
    dev = q.device
    out = torch.zeros(1, hq, d, device=dev, dtype=q.dtype)
    indptr = torch.tensor([0, n], dtype=torch.int32, device=dev)
    indices = torch.arange(n, dtype=torch.int32, device=dev)
    logits = torch.zeros(1, hq, splits, d, device=dev, dtype=torch.float32)
    lse = torch.zeros(1, hq, splits, device=dev, dtype=torch.float32)
    nsplit = torch.tensor([splits], dtype=torch.int32, device=dev)
    decode_attention_fwd(q[None], k, v, out, indptr, indices, logits, lse, nsplit, splits, 1 / math.sqrt(d), 1.0, 1.0)
    return out[0]


def ours(q, k, v):
    """The overlay's attention in its decode form, one sequence holding every key of k, v."""
    import torch
    from true_on_policy.kernels.attention import attention

    n = k.shape[0]
    table = torch.arange(n, dtype=torch.int32, device=q.device)[None]
    return attention(q[None].bfloat16(), k.bfloat16(), v.bfloat16(), table, None, None, None, 1, max_kv_len=n,
                     seq_lens=torch.tensor([n], device=q.device))[0]


def check(hq: int, hkv: int, d: int, context: int, tol: float, seed: int = 0) -> dict:
    import torch

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(hq, d, generator=gen).to(dev)
    k, v = (torch.randn(context, hkv, d, generator=gen).to(dev) for _ in range(2))
    row = {"heads": [hq, hkv, d], "group": hq // hkv, "context": context}
    for name, fn, given in (("stock", stock, (q, k, v)), ("ours", ours, tuple(t.bfloat16() for t in (q, k, v)))):
        err = (fn(q, k, v).float() - reference(*given)).abs().amax(-1)  # the reference at the inputs it serves
        row[name] = {"max_err": float(err.max()), "heads_off": [h for h in range(hq) if float(err[h]) > tol]}
    return row


def main(argv=None) -> int:
    import geometries

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--geometries", nargs="+", default=list(geometries.SPACE), choices=list(geometries.SPACE))
    p.add_argument("--context", type=int, default=40, help="keys in the sequence (default 40)")
    p.add_argument("--tol", type=float, default=0.05, help="largest error per head still on the reference")
    p.add_argument("--out", help="write the evidence here")
    a = p.parse_args(argv)
    interpreted = _interpret_without_cuda()
    from true_on_policy.harness.provenance import provenance, write_evidence

    prov = provenance(None if argv is None else ["python", "benchmarks/stock_decode_groups.py", *argv])
    rows = []
    for name in a.geometries:
        s = geometries.SPACE[name]
        row = {"geometry": name, **check(s["num_attention_heads"], s["num_key_value_heads"], s["head_dim"],
                                         a.context, a.tol)}
        rows.append(row)
        print(f"{name}: heads {row['heads'][0]}/{row['heads'][1]} (group {row['group']}): stock max err "
              f"{row['stock']['max_err']:.3g}, heads off {row['stock']['heads_off'] or 'none'}; ours max err "
              f"{row['ours']['max_err']:.3g}, heads off {row['ours']['heads_off'] or 'none'}", flush=True)
    if a.out:
        write_evidence(a.out, {"interpreted": interpreted, "tol": a.tol, "rows": rows,
                               "stock_off": sorted(r["geometry"] for r in rows if r["stock"]["heads_off"]),
                               "ours_off": sorted(r["geometry"] for r in rows if r["ours"]["heads_off"])}, prov)
    return 0


if __name__ == "__main__":
    sys.exit(main())
