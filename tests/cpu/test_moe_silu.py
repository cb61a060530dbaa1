"""TRUE_ON_POLICY_MOE_SILU: the MoE's silu(gate) * up formed in the flat down projection's load.

- interpreted (TRITON_INTERPRET=1), the grouped TMA kernel with ``silu`` computes, for every tile
  of the down projection's candidates and with and without the block loop, the bits of
  ``moe.silu_mul``'s rows fed to the same kernel; ``moe.moe`` (TMA taken as on Hopper) gives the
  same output with ``SILU_IN_DOWN`` on and off, at decode and prefill token counts, single-process
  and as one EP rank's expert outputs;
- ``grouped_matmul(silu=True)`` is refused off the TMA decode path, naming ``silu_fusable``;
- the mode: 'separate' (also unset) or 'fused', anything else refused naming the variable; the
  patches set ``kernels.moe.SILU_IN_DOWN`` from it.
"""

import pytest
import torch
from helpers import run_py
from true_on_policy.kernels import matmul as mm
from true_on_policy.kernels import moe
from true_on_policy.kernels.limits import KernelLimitError

from true_on_policy.patching import PatchError

INTERPRETED = r"""
import torch
from true_on_policy.kernels import grouped_tma, matmul as mm, moe

g = torch.Generator().manual_seed(3)
E, H, I, TOPK = 6, 40, 48, 2  # neither H nor I a multiple of the tiles' BLOCK_N / BLOCK_K
w13 = (torch.randn(E, 2 * I, H, generator=g) * 0.2).bfloat16()
w2 = (torch.randn(E, H, I, generator=g) * 0.2).bfloat16()
router = (torch.randn(E, H, generator=g) * 0.2).bfloat16()
# direct: every down candidate tile, one tile per program over the table and the block loop
for t in (1, 40):
    ids = torch.stack([torch.randperm(E, generator=g)[:TOPK] for _ in range(t)]).int()
    rows, be, pos, own = moe.align(ids, 0, E)
    gate_up = (torch.randn(rows.shape[0], 2 * I, generator=g) * 2).bfloat16()
    h = moe.silu_mul(gate_up, pos)
    real = (be >= 0).repeat_interleave(mm.ALIGN) & (own >= 0)
    for cfg in mm.candidate_tiles("down")[:4]:
        for sub in (1, mm.ALIGN // cfg["BLOCK_M"]):
            count = own.shape[0] if sub == 1 else mm.used_blocks(t * TOPK, E) * mm.ALIGN
            b = be.repeat_interleave(mm.ALIGN // (cfg["BLOCK_M"] * sub))
            want = grouped_tma.launch(h, w2, torch.full((own.shape[0], H), float("nan")), own, b, count, cfg,
                                      subtiles=sub)
            got = grouped_tma.launch(gate_up, w2, torch.full((own.shape[0], H), float("nan")), own, b, count, cfg,
                                     subtiles=sub, silu=True)
            assert torch.equal(got[real], want[real]), ("tile", cfg, sub, t)
# the dispatch: TMA taken as on Hopper; moe() with the fusion on and off
grouped_tma.usable = lambda x, w: True
mm.hopper = lambda x: True
mm.sm_count = lambda x: 132
taken = []
launch = grouped_tma.launch
grouped_tma.launch = lambda *a, **k: taken.append(k.get("silu", False)) or launch(*a, **k)
for t in (1, 9, 300):  # 300 tokens: past grouped_decode, the separate launch either way
    x = torch.randn(t, H, generator=g).bfloat16()
    ids = moe.route(mm.matmul(x, router), TOPK)[1]
    for width in (1, 8):  # the flat contract's one K loop; v1's tree (seg_tree: never fused)
        outs = {}
        for on in (True, False):
            moe.SILU_IN_DOWN = on
            del taken[:]
            outs[on] = (moe.moe(x, router, w13, w2, TOPK, width=width),
                        moe.expert_outputs(x, ids, w13[2:4].contiguous(), w2[2:4].contiguous(), 2, 1, width))
            fused = on and width == 1
            assert taken.count(True) == fused * (mm.grouped_decode(t, t * TOPK, E) + mm.grouped_decode(t, t * TOPK, 2)), (
                t, width, on, taken)
        assert torch.equal(outs[True][0], outs[False][0]), ("moe", t, width)
        assert torch.equal(outs[True][1], outs[False][1]), ("ep rank", t, width)
print("silu-ok")
"""


def test_silu_in_the_down_load_computes_silu_mul_then_the_gemm_interpreted():
    r = run_py(INTERPRETED, {"TRITON_INTERPRET": "1", "OPENBLAS_NUM_THREADS": "1"}, timeout=600)
    assert r.returncode == 0 and "silu-ok" in r.stdout, r.stderr[-3000:]


def test_silu_in_the_down_gemm_is_refused_off_the_tma_decode_path():
    e, h, i = 4, 32, 16
    ids = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    rows, be, pos = moe.align_reference(ids, 0, e)
    own = torch.where(rows >= 0, torch.arange(rows.shape[0]), -1)
    gate_up = torch.zeros(rows.shape[0], 2 * i, dtype=torch.bfloat16)
    w2 = torch.zeros(e, h, i, dtype=torch.bfloat16)
    assert not mm.silu_fusable(gate_up, w2, 2, 4)  # no Hopper GPU here
    with pytest.raises(KernelLimitError, match="silu_fusable"):
        mm.grouped_matmul(gate_up, w2, own, be, torch.float32, role="down", tokens=2, slots=4, silu=True)


@pytest.mark.parametrize("value", ["fuse", "1", "FUSED", "off"])
def test_a_moe_silu_value_outside_separate_and_fused_is_refused_naming_the_variable(value, monkeypatch):
    from true_on_policy.patches import qwen3_moe

    monkeypatch.setenv("TRUE_ON_POLICY_MOE_SILU", value)
    with pytest.raises(PatchError, match="TRUE_ON_POLICY_MOE_SILU") as e:
        qwen3_moe.apply(None)
    assert "'fused'" in str(e.value) and repr(value.strip()) in str(e.value)


@pytest.mark.parametrize("value,mode", [("", "separate"), ("separate", "separate"), (" fused ", "fused")])
def test_the_moe_silu_modes(value, mode, monkeypatch):
    from true_on_policy.patches import qwen3_moe

    monkeypatch.setenv("TRUE_ON_POLICY_MOE_SILU", value)
    assert qwen3_moe.moe_silu_mode() == mode


APPLY = """
from true_on_policy.kernels import moe
from true_on_policy.patches import qwen3_moe
moe.SILU_IN_DOWN = None
record = qwen3_moe.apply(None)
print(moe.SILU_IN_DOWN, "TRUE_ON_POLICY_MOE_SILU=fused" in " ".join(record.notes))
"""


@pytest.mark.parametrize("value,on", [("", False), ("separate", False), ("fused", True)])
def test_the_patches_set_the_kernel_flag_from_the_mode(value, on):
    r = run_py(APPLY, {"TRUE_ON_POLICY_MOE_SILU": value})
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == [str(on), str(on)]
