"""TRUE_ON_POLICY_MOE_SILU: the MoE's silu(gate) * up stored by the gate/up GEMM (its GLU form).

- interpreted (TRITON_INTERPRET=1), the grouped TMA kernel's GLU form computes, for every tile of
  the gate/up candidates and with and without the block loop, ``moe.silu_mul`` of the same kernel's
  gate/up rows; ``moe.moe`` (TMA taken as on Hopper) gives the same output with ``SILU_IN_UP`` on and
  off, at decode and prefill token counts, both tree widths, single-process and as one EP rank's
  expert outputs, and takes the GLU form exactly where ``glu_fusable`` holds;
- ``grouped_matmul(glu=True)`` is refused off the TMA decode path, naming ``glu_fusable``;
- the mode, 'separate' (also unset) or 'up', its parsing, the refusal of any other value and the patches
  setting ``kernels.moe.SILU_IN_UP`` from it: test_speed_switches.py.
"""

import pytest
import torch
from helpers import run_py
from true_on_policy.kernels import matmul as mm
from true_on_policy.kernels import moe
from true_on_policy.kernels.limits import KernelLimitError

INTERPRETED = r"""
import torch
from true_on_policy.kernels import grouped_tma, matmul as mm, moe

g = torch.Generator().manual_seed(3)
E, H, I, TOPK = 6, 40, 48, 2  # neither H nor I a multiple of the tiles' BLOCK_N / BLOCK_K
w13 = (torch.randn(E, 2 * I, H, generator=g) * 0.2).bfloat16()
w2 = (torch.randn(E, H, I, generator=g) * 0.2).bfloat16()
router = (torch.randn(E, H, generator=g) * 0.2).bfloat16()
# direct: gate/up candidate tiles, one tile per program over the table and the block loop
for t in (1, 40):
    x = (torch.randn(t, H, generator=g) * 2).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:TOPK] for _ in range(t)]).int()
    rows, be, pos, own = moe.align(ids, 0, E)
    real = (be >= 0).repeat_interleave(mm.ALIGN) & (rows >= 0)
    for cfg in mm.candidate_tiles("gate_up")[:4]:
        for sub in (1, mm.ALIGN // cfg["BLOCK_M"]):
            count = rows.shape[0] if sub == 1 else mm.used_blocks(t * TOPK, E) * mm.ALIGN
            b = be.repeat_interleave(mm.ALIGN // (cfg["BLOCK_M"] * sub))
            gate_up = grouped_tma.launch(x, w13, torch.full((rows.shape[0], 2 * I), float("nan")).bfloat16(), rows, b,
                                         count, cfg, subtiles=sub)
            want = moe.silu_mul(gate_up, pos)
            got = grouped_tma.launch(x, w13, torch.full((rows.shape[0], I), float("nan")).bfloat16(), rows, b, count,
                                     cfg, subtiles=sub, glu=True)
            assert torch.equal(got[real], want[real]), ("tile", cfg, sub, t)
# the dispatch: TMA taken as on Hopper; moe() with the GLU form on and off
grouped_tma.usable = lambda x, w: True
mm.hopper = lambda x: True
mm.sm_count = lambda x: 132
taken = []
launch = grouped_tma.launch
grouped_tma.launch = lambda *a, **k: taken.append(k.get("glu", False)) or launch(*a, **k)
for t in (1, 9, 300):  # 300 tokens: past grouped_decode, the separate launch either way
    x = torch.randn(t, H, generator=g).bfloat16()
    ids = moe.route(mm.matmul(x, router), TOPK)[1]
    for width in (1, 8):  # the flat contract's one K loop; v1's tree down projection
        outs = {}
        for on in (True, False):
            moe.SILU_IN_UP = on
            del taken[:]
            outs[on] = (moe.moe(x, router, w13, w2, TOPK, width=width),
                        moe.expert_outputs(x, ids, w13[2:4].contiguous(), w2[2:4].contiguous(), 2, 1, width))
            want = on * (mm.glu_fusable(x, w13, t, t * TOPK) + mm.glu_fusable(x, w13[2:4], t, t * TOPK))
            assert taken.count(True) == want, (t, width, on, taken)
        assert torch.equal(outs[True][0], outs[False][0]), ("moe", t, width)
        assert torch.equal(outs[True][1], outs[False][1]), ("ep rank", t, width)
print("silu-ok")
"""


def test_the_glu_form_stores_silu_mul_of_the_gate_up_rows_interpreted():
    r = run_py(INTERPRETED, {"TRITON_INTERPRET": "1", "OPENBLAS_NUM_THREADS": "1"}, timeout=600)
    assert r.returncode == 0 and "silu-ok" in r.stdout, r.stderr[-3000:]


def test_the_glu_form_is_refused_off_the_tma_decode_path():
    e, h, i = 4, 32, 16
    ids = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    rows, be, _ = moe.align_reference(ids, 0, e)
    x = torch.zeros(2, h, dtype=torch.bfloat16)
    w13 = torch.zeros(e, 2 * i, h, dtype=torch.bfloat16)
    assert not mm.glu_fusable(x, w13, 2, 4)  # no Hopper GPU here
    with pytest.raises(KernelLimitError, match="glu_fusable"):
        mm.grouped_matmul(x, w13, rows, be, tokens=2, slots=4, glu=True)
