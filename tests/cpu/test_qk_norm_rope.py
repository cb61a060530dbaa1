"""TRUE_ON_POLICY_QK_NORM_ROPE: the Qwen3-MoE attention's QK-norm in its RoPE launch.

'fused' (the default: also when unset) replaces ``Qwen3MoeAttention.apply_qk_norm_rope`` (sglang
0.5.17's real class) by one launch that QK-norms, rotates and writes the K/V rows; on the CPU
(TRITON_INTERPRET=1) its q, k and cache rows are the separate path's bits (``rmsnorm_heads``, then
the patched RoPE with SGLang's ``FusedSetKVBufferArg``), for a head in the norm's tile form and for
one wider than it (normed in launches of its own first), and the attention is left to save the K/V
exactly when nothing was written. 'separate' leaves the method as SGLang wrote it (the mode's parsing
and the refusal of any other value: test_speed_switches.py). The GPU tier checks the kernel's bits on
the device (test_kernels_gpu.py::test_qk_norm_in_the_rope_launch_is_rmsnorm_then_ropes_bits)."""

import pytest
from helpers import run_py

CODE = r"""
import os, torch, types
from true_on_policy import patches
from true_on_policy.contract import get_contract
from true_on_policy.contract.policy import RuntimePolicy
from true_on_policy.patching import PatchError
from true_on_policy.patches import qwen3_moe
from true_on_policy.kernels.rmsnorm import rmsnorm_heads
from sglang.srt.models import qwen3_moe as m
from sglang.srt.layers.rotary_embedding.base import RotaryEmbedding
from sglang.kernels.ops.attention.rope import FusedSetKVBufferArg

SGLANG_OWN = 'Qwen3MoeAttention.apply_qk_norm_rope'  # (the plugin may have patched it as sglang loaded)
patches.apply_all(RuntimePolicy(get_contract('qwen3_moe_true_on_policy_flat_v1'), 'scheduler'))
fused = os.environ.get('TRUE_ON_POLICY_QK_NORM_ROPE') != 'separate'
if not fused:
    own = m.Qwen3MoeAttention.apply_qk_norm_rope
    assert own.__qualname__ == SGLANG_OWN and not hasattr(own, '__wrapped__'), own
    print('qknr-ok')
    raise SystemExit
assert m.Qwen3MoeAttention.apply_qk_norm_rope.__wrapped__.__qualname__ == SGLANG_OWN

from true_on_policy.kernels.rmsnorm import TILE_H


def check(d):  # a head in the norm's tile form, and one wider (normed first)
    g = torch.Generator().manual_seed(d)
    hq, hkv, n, slots = 4, 2, 5, 12
    emb = RotaryEmbedding.__new__(RotaryEmbedding)
    object.__setattr__(emb, '__dict__', dict(head_size=d, rotary_dim=d, is_neox_style=True, base=1000000))
    norm = lambda eps: types.SimpleNamespace(weight=(1 + 0.1 * torch.randn(d, generator=g)).bfloat16(), variance_epsilon=eps)
    attn = m.Qwen3MoeAttention.__new__(m.Qwen3MoeAttention)
    object.__setattr__(attn, '__dict__', dict(q_size=hq * d, kv_size=hkv * d, head_dim=d, rotary_emb=emb,
                                              q_norm=norm(1e-6), k_norm=norm(1e-5), attn=None, training=False,
                                              compatible_with_fused_kv_buffer=True, _used_fused_qk_norm_rope_last_call=True))
    pos = torch.tensor([0, 5, 63, 64, 200])
    qkv = (3 * torch.randn(n, (hq + 2 * hkv) * d, generator=g)).bfloat16()
    qs, ks, vs = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    qn = rmsnorm_heads(qs, attn.q_norm.weight, 1e-6).view(n, -1)
    kn = rmsnorm_heads(ks, attn.k_norm.weight, 1e-5).view(n, -1)
    kb0, vb0 = torch.randn(slots, hkv * d, generator=g).bfloat16(), torch.randn(slots, hkv * d, generator=g).bfloat16()
    loc = torch.tensor([7, 0, 11, 3, 4])
    rest = torch.ones(slots, dtype=torch.bool)
    rest[loc] = False
    kb1, vb1 = kb0.clone(), vb0.clone()  # the separate path: the patched RoPE on the normed q/k, SGLang's K/V argument
    qo, ko = RotaryEmbedding.forward_native(emb, pos, qn, kn, fused_set_kv_buffer_arg=FusedSetKVBufferArg(
        value=vs, k_buffer=kb1, v_buffer=vb1, cache_loc=loc))
    for writes in (True, False):  # SGLang fuses the K/V write (bf16 cache on CUDA) or leaves it to the attention
        kb, vb = kb0.clone(), vb0.clone()
        m.enable_fused_set_kv_buffer = lambda fb, w=writes: w
        m.create_fused_set_kv_buffer_arg = lambda value, layer, forward_batch: FusedSetKVBufferArg(
            value=value, k_buffer=kb, v_buffer=vb, cache_loc=loc)
        attn._used_fused_qk_norm_rope_last_call = True
        q, k, v = m.Qwen3MoeAttention.apply_qk_norm_rope(attn, qkv, pos, None)
        assert torch.equal(q, qo) and torch.equal(k, ko) and torch.equal(v, vs), writes
        assert q.shape == qs.shape and k.shape == ks.shape and attn._used_fused_qk_norm_rope_last_call is False
        if writes:
            assert torch.equal(kb, kb1) and torch.equal(vb, vb1) and torch.equal(kb[loc], ko) and torch.equal(vb[loc], vs)
        else:
            assert torch.equal(kb, kb0) and torch.equal(vb, vb0)
    bad = types.SimpleNamespace(weight=torch.ones(2 * d).bfloat16(), variance_epsilon=1e-6)
    object.__setattr__(attn, 'k_norm', bad)
    try:
        m.Qwen3MoeAttention.apply_qk_norm_rope(attn, qkv, pos, None)
    except PatchError as e:
        assert 'per-head QK-norm' in str(e) and 'apply_qk_norm_rope' in str(e), e
    else:
        raise AssertionError('a norm over two heads accepted')


for d in (64, 2 * TILE_H):
    check(d)
print('qknr-ok')
"""


@pytest.mark.parametrize("mode", ["fused", "", "separate"])
def test_the_fused_qk_norm_rope_seam_gives_the_separate_paths_q_k_and_cache_rows(mode):
    r = run_py(CODE, {"TRITON_INTERPRET": "1", "TRUE_ON_POLICY_QK_NORM_ROPE": mode})
    assert r.returncode == 0 and "qknr-ok" in r.stdout, r.stderr[-4000:]
