"""The MoE block's token chunks on the CPU: a pass whose fp32 down-projection output would pass the bound
runs in the fewest equal chunks that keep it under, and one that fits runs whole. That the chunks keep every
bit, in one process and under TP and EP: interpreted (interpreted/moe_logprobs.py, collectives_gloo.py)."""

import pytest
from true_on_policy.kernels import moe as M
from true_on_policy.kernels.matmul import ALIGN

GIB = 1 << 30
H100, H200 = int(79.18 * GIB) // M.MOE_DOWN_SHARE, int(139.8 * GIB) // M.MOE_DOWN_SHARE


@pytest.mark.parametrize("t", [1, 7, 256, 4096, 8192, 16384, 65536])
@pytest.mark.parametrize("k,h,e", [(8, 2048, 128), (8, 4096, 128), (8, 6144, 160), (8, 7168, 256), (2, 64, 8)])
@pytest.mark.parametrize("cap", [H100, H200, 300_000, None])
def test_a_pass_runs_whole_when_it_fits_else_in_the_fewest_equal_chunks_under_the_bound(t, k, h, e, cap):
    c = M.token_chunk(t, k, h, e, cap)
    n = -(-t // c)
    assert 1 <= c <= t and (n - 1) * c < t  # equal chunks, the last shorter, none empty
    if cap is None or M.down_bytes(t, k, h, e) <= cap:
        assert c == t
        return
    floor = max(1, ALIGN // k)
    assert M.down_bytes(c, k, h, e) <= cap or c <= floor  # under the bound, unless one block of slots is not
    fewer = -(-t // (n - 1)) if n > 1 else t  # one chunk fewer would pass it
    assert M.down_bytes(fewer, k, h, e) > cap or c <= floor


def test_a_wide_prefill_chunk_is_halved_on_80_gb_and_the_shapes_that_fit_are_not():
    assert M.token_chunk(8192, 8, 6144, 160, H100) == 4096  # Coder-480B's 8,192-token prefill chunk: 1.97 GiB
    assert M.token_chunk(8192, 8, 6144, 160, H200) == 8192
    assert M.token_chunk(8192, 8, 4096, 128, H100) == 8192  # 235B-A22B
    assert M.token_chunk(16384, 8, 4096, 128, H200) == 16384
    assert M.token_chunk(256, 8, 6144, 160, H100) == 256  # a decode graph's batch


def test_the_bound_is_the_set_bytes_else_a_share_of_the_gpu_and_none_off_it(monkeypatch):
    import torch

    assert M.down_cap(torch.zeros(1)) is None
    monkeypatch.setattr(M, "MOE_DOWN_BYTES", 12345)
    assert M.down_cap(torch.zeros(1)) == 12345
