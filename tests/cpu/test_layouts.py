"""Model layouts on the CPU: the per-rank head layout SGLang gives attention under TP (split or
replicated KV heads) is the kernel's GQA pairing for every public Qwen3-MoE geometry."""

import types

import pytest
import torch

from true_on_policy.patching import PatchError

# (query heads, KV heads) of the public checkpoints: 30B-A3B / Coder-30B, 235B-A22B, Coder-480B
GEOMETRIES = [(32, 4), (64, 4), (96, 8), (6, 2)]


def _sglang_rank(hq: int, hkv: int, tp: int, rank: int):
    """Qwen3MoeAttention / QKVParallelLinear (sglang 0.5.17): this rank's query heads (global ids)
    and its KV heads (global ids); KV heads are replicated over tp / Hkv ranks when tp > Hkv."""
    n_q = hq // tp
    if tp >= hkv:
        kv = [rank // (tp // hkv)]
    else:
        kv = list(range(rank * hkv // tp, (rank + 1) * hkv // tp))
    return list(range(rank * n_q, (rank + 1) * n_q)), kv


@pytest.mark.parametrize("hq,hkv", GEOMETRIES)
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_rank_heads_keep_the_global_gqa_pairing(hq, hkv, tp):
    from true_on_policy.patches.attention_backend import _rank_heads

    if hq % tp:
        pytest.skip("SGLang refuses Hq % tp != 0")
    for rank in range(tp):
        q_ids, kv_ids = _sglang_rank(hq, hkv, tp, rank)
        layer = types.SimpleNamespace(tp_q_head_num=len(q_ids), tp_k_head_num=len(kv_ids), qk_head_dim=128,
                                      layer_id=0)
        n_q, n_kv, d = _rank_heads(layer, torch.empty(3, len(kv_ids), 128))
        g = n_q // n_kv
        assert 1 <= g <= 64 and d == 128
        for i, h in enumerate(q_ids):  # the kernel reads local KV head i // g
            assert kv_ids[i // g] == h // (hq // hkv), (hq, hkv, tp, rank, i)


def test_rank_heads_refuse_a_pool_of_another_layout():
    from true_on_policy.patches.attention_backend import _rank_heads

    layer = types.SimpleNamespace(tp_q_head_num=12, tp_k_head_num=1, qk_head_dim=128, layer_id=3)
    with pytest.raises(PatchError, match="layer 3 has 12 query / 1 KV heads"):
        _rank_heads(layer, torch.empty(3, 2, 128))
    with pytest.raises(PatchError):
        _rank_heads(types.SimpleNamespace(tp_q_head_num=6, tp_k_head_num=4, qk_head_dim=64, layer_id=0),
                    torch.empty(3, 4, 64))
