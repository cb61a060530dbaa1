"""TRUE_ON_POLICY_PREFILL_LOOP: the prefill attention's fixed tile in its nested loop (the default) or the flat
loop, set as the patches install, or the prefill tile chosen at start-up (``choose``: the fastest of
``prefill_candidates``, timed before the first CUDA-graph capture); a refused value changes nothing (the refusal itself:
test_speed_switches.py). That
every candidate gives the same bits: interpreted (interpreted/attention_rope.py) and on the GPU
(test_attention_tiles_equal_prefill, test_attention_prefill_flat_loop_keeps_the_bits,
test_attention_prefill_choice_keeps_the_bits)."""

import pytest
from helpers import FAKE_MODEL_RUNNER, run_py
from true_on_policy.kernels import attention as A
from true_on_policy.kernels.limits import KernelLimitError

from true_on_policy.patching import PatchError


def test_a_refused_prefill_loop_changes_nothing(monkeypatch):
    """(The refusal itself, for every speed-only switch: test_speed_switches.py.)"""
    from true_on_policy.patches import attention_backend

    monkeypatch.setenv("TRUE_ON_POLICY_PREFILL_LOOP", "FLAT")
    before = A.prefill_loop()
    with pytest.raises(PatchError, match="TRUE_ON_POLICY_PREFILL_LOOP"):
        attention_backend.apply(None)
    assert A.prefill_loop() == before


def test_set_prefill_loop_installs_the_flat_loop_for_the_prefill_form_only_and_refuses_others():
    try:
        A.set_prefill_loop("flat")
        assert A.prefill_loop() == "flat" and A._PREFILL_TILE == {"loop": "flat"}
        A.set_prefill_loop("nested")
        assert A.prefill_loop() == "nested" and A._PREFILL_TILE == {}
        with pytest.raises(KernelLimitError, match="'wide'"):
            A.set_prefill_loop("wide")
        assert A.prefill_loop() == "nested"
    finally:
        A.set_prefill_loop("nested")


APPLY = """
from true_on_policy.kernels import attention
from true_on_policy.patches import attention_backend
attention.set_prefill_tile(24, 6, 128, attention.prefill_candidates()[3])  # left from an earlier install
record = attention_backend.apply(None)
notes = " ".join(record.notes)
print(attention.prefill_loop(), "TRUE_ON_POLICY_PREFILL_LOOP=flat" in notes, "TRUE_ON_POLICY_PREFILL_LOOP=choose" in notes,
      attention.prefill_tile_for(24, 6, 128) == attention._PREFILL_TILE)
"""


@pytest.mark.parametrize("value,loop", [("", "nested"), ("nested", "nested"), ("flat", "flat"), ("choose", "nested")])
def test_the_patches_set_the_prefill_loop_from_the_mode(value, loop):
    """The loop the prefill runs until a choice is made (choose: nested), the note naming the mode, and no
    tile left installed from before."""
    r = run_py(APPLY, {"TRUE_ON_POLICY_PREFILL_LOOP": value})
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == [loop, str(value == "flat"), str(value == "choose"), "True"]


def test_the_prefill_candidates_are_the_fixed_tile_in_the_prefill_and_decode_stages_in_both_loops():
    cands = A.prefill_candidates()
    assert cands[0] == dict(BLOCK_M=A.BLOCK_M, num_warps=A.NUM_WARPS, num_stages=A.NUM_STAGES["extend"])
    assert {(t["num_stages"], t.get("loop")) for t in cands} == {
        (A.NUM_STAGES["extend"], None), (A.NUM_STAGES["decode"], None),
        (A.NUM_STAGES["extend"], "flat"), (A.NUM_STAGES["decode"], "flat")}
    assert len(cands) == 4 and all(t["BLOCK_M"] == A.BLOCK_M and t["num_warps"] == A.NUM_WARPS for t in cands)
    for t in cands:
        A._check_tile(t, 8)  # every one a launch tile the kernel takes


def test_a_prefill_tile_is_installed_per_head_layout_and_a_non_candidate_refused():
    s3_flat = A.prefill_candidates()[3]
    try:
        A.set_prefill_tile(24, 6, 128, s3_flat)
        assert A.prefill_tile_for(24, 6, 128) == s3_flat
        assert A.prefill_tile_for(32, 4, 128) == {}  # another layout: the loop's default
        A.set_prefill_loop("flat")
        assert A.prefill_tile_for(32, 4, 128) == {"loop": "flat"} and A.prefill_tile_for(24, 6, 128) == s3_flat
        A.set_prefill_tile(24, 6, 128, None)  # the default chosen: the loop's
        assert A.prefill_tile_for(24, 6, 128) == {"loop": "flat"}
        one_warp = dict(BLOCK_M=16, num_warps=1, num_stages=3, loop="flat")
        for bad in (one_warp, dict(s3_flat, split=2), dict(s3_flat, num_stages=2)):
            with pytest.raises(KernelLimitError, match="not a candidate"):
                A.set_prefill_tile(24, 6, 128, bad)
        assert A.prefill_tile_for(24, 6, 128) == {"loop": "flat"}
        A.clear_prefill_tiles()
        A.set_prefill_loop("nested")
        assert A.prefill_tile_for(24, 6, 128) == {}
    finally:
        A.clear_prefill_tiles()
        A.set_prefill_loop("nested")


@pytest.mark.parametrize("times,pick", [
    # ms per candidate per shape (4:1024, 1:4096): the fastest summed over the shapes, if 3 % under the default
    ({"4:1024": [1.0, 0.9, 1.1, 0.8], "1:4096": [4.0, 3.9, 4.2, 3.0]}, 3),
    ({"4:1024": [1.0, 0.9, 1.1, 0.8], "1:4096": [4.0, 3.9, 4.2, 4.3]}, 1),
    ({"4:1024": [1.0, 0.99, 1.1, 1.2], "1:4096": [4.0, 3.95, 4.2, 4.3]}, None),  # 1.2 % faster: within the margin
    ({"4:1024": [1.0, 1.1, 1.2, 1.3], "1:4096": [4.0, 4.1, 4.2, 4.3]}, None),
])
def test_the_prefill_choice_takes_the_fastest_over_its_shapes_and_installs_it(times, pick, monkeypatch):
    import torch

    calls = []

    def fake(hq, d, b, new, tiles, k, v, max_kv_len, rounds, reps, gen):
        calls.append((hq, d, b, new, [dict(t) for t in tiles], max_kv_len))
        return times[f"{b}:{new}"]
    monkeypatch.setattr(A, "_time_prefill", fake)
    k = torch.zeros(10, 6, 128, dtype=torch.bfloat16)
    out = {}
    try:
        tile = A.choose_prefill_tile(24, 6, 128, k, k.clone(), 40960, times_out=out)
        cands = A.prefill_candidates()
        assert calls == [(24, 128, b, n, cands, 40960) for b, n in A.PREFILL_CHOICE_SHAPES]
        assert tile == (None if pick is None else cands[pick])
        assert A.prefill_tile_for(24, 6, 128) == (tile or {})
        assert out == {s: {A.tile_label(t): m for t, m in zip(cands, ms, strict=True)} for s, ms in times.items()}
    finally:
        A.clear_prefill_tiles()


def test_the_prefill_choice_refuses_a_layout_the_kernel_does_not_cover():
    import torch

    k = torch.zeros(10, 6, 96, dtype=torch.bfloat16)
    with pytest.raises(KernelLimitError, match="head_dim 96"):
        A.choose_prefill_tile(24, 6, 96, k, k, 40960)
    assert A.prefill_tile_for(24, 6, 96) == {}


CAPTURE = FAKE_MODEL_RUNNER + r"""
import os
calls = []
att.choose_decode_tiles = lambda hq, hkv, d, batches, k, v, width: {b: None for b in batches}
att.choose_prefill_tile = lambda hq, hkv, d, k, v, width: (
    calls.append((hq, hkv, d, tuple(k.shape), tuple(v.shape), width)) or att.prefill_candidates()[hq // 8])

class Runner:
    capture_bs, capture_num_tokens, model_runner = [1, 2, 24], [4, 8], MR()

os.environ['TRUE_ON_POLICY_PREFILL_LOOP'] = 'nested'
cuda_graph._make_capture(lambda self: None)(Runner())
assert calls == [] and 'prefill_tiles' not in cuda_graph.CAPTURED, calls  # not 'choose': no timing
os.environ['TRUE_ON_POLICY_PREFILL_LOOP'] = 'choose'
cuda_graph._make_capture(lambda self: None, cuda_graph.PREFILL_CAPTURE)(Runner())  # the first capture of either
assert calls == [(8, 2, 128, (10, 2, 128), (10, 2, 128), 40960), (16, 4, 64, (10, 4, 64), (10, 4, 64), 40960)], calls
assert cuda_graph.CAPTURED['prefill_tiles'] == [{'heads': [8, 2, 128], 'tile': att.prefill_candidates()[1]},
                                                {'heads': [16, 4, 64], 'tile': att.prefill_candidates()[2]}]
assert isinstance(cuda_graph.CAPTURED['prefill_tiles_s'], float)
cuda_graph._make_capture(lambda self: None)(Runner())  # the decode capture after it: no second timing
assert len(calls) == 2, calls
print('ok')
"""


def test_the_first_graph_capture_chooses_the_prefill_tile_for_every_head_layout_only_under_choose():
    r = run_py(CAPTURE, env_extra={"TRUE_ON_POLICY_PREFILL_LOOP": "choose"})
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
