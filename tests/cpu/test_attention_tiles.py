"""The decode attention's candidate tiles and the start-up choice among them, on the CPU: which tiles
are candidates, how the choice picks, installs and is looked up, which batches it times, and that
the decode CUDA-graph capture runs it on every head layout of the model unless
TRUE_ON_POLICY_DECODE_TILES=fixed. That a chosen tile keeps the bits: interpreted
(interpreted/attention_groups.py) and on the GPU (test_attention_tiles_equal_prefill,
test_attention_tiles_chosen_at_start_up_keep_the_bits)."""

import pytest
from helpers import FAKE_MODEL_RUNNER, run_py
from true_on_policy.kernels import attention as A
from true_on_policy.kernels.limits import KernelLimitError
from true_on_policy.patches import cuda_graph


@pytest.mark.parametrize("g", [1, 2, 4, 6, 8, 12, 16, 20, 32, 48, 64])
def test_candidates_are_the_fixed_tile_then_one_warp_tiles_holding_a_group_then_each_in_the_flat_loop(g):
    c = A.candidate_tiles(g)
    nested, flat = c[:len(c) // 2], c[len(c) // 2:]
    assert nested[0] == dict(BLOCK_M=A.BLOCK_M, num_warps=A.NUM_WARPS, num_stages=A.NUM_STAGES["decode"])
    assert all(t["num_warps"] == 1 and g <= t["BLOCK_M"] <= 32 and "loop" not in t for t in nested[1:])
    assert {(t["BLOCK_M"], t["num_stages"]) for t in nested[1:]} == {(bm, st) for bm in (16, 32) if bm >= g
                                                                      for st in (1, 2, 3)}
    assert flat == [dict(t, loop="flat") for t in nested]
    assert all(t in c for t in A.chooser_tiles(g))


def test_a_loop_other_than_flat_is_refused():
    import torch

    q = torch.zeros(1, 4, 128, dtype=torch.bfloat16)
    kv = torch.zeros(8, 1, 128, dtype=torch.bfloat16)
    with pytest.raises(KernelLimitError, match="loop 'wide'"):
        A.attention(q, kv, kv, torch.zeros(1, 8, dtype=torch.int32), None, None, None, 1, seq_lens=torch.ones(1,
                    dtype=torch.int32), tile=dict(BLOCK_M=16, num_warps=1, num_stages=2, loop="wide"))
    assert A.tile_label(dict(BLOCK_M=16, num_warps=1, num_stages=2, loop="flat", split=4)) == "16 rows w1 s2 flat split 4"


def test_pick_tile_keeps_the_fixed_tile_unless_a_candidate_is_faster_by_the_margin():
    assert A.pick_tile({None: 1.0, 0: 0.99, 1: 0.98}) is None  # 2 % faster: within the margin
    assert A.pick_tile({None: 1.0, 0: 0.9, 1: 0.8}) == 1
    assert A.pick_tile({None: 1.0}) is None
    assert A.pick_tile({None: 1.0, 0: 0.9}, margin=0.2) is None


def test_decode_tile_for_takes_the_next_timed_batch_up_and_refuses_a_tile_not_a_candidate():
    small, mid = A.candidate_tiles(4)[1], A.candidate_tiles(4)[-1]
    try:
        assert A.decode_tile_for(24, 6, 128, 1) is None  # nothing chosen: the fixed tile
        A.set_decode_tiles(24, 6, 128, {64: mid, 1: None, 16: small})
        assert [A.decode_tile_for(24, 6, 128, b) for b in (1, 2, 16, 17, 64, 65, 512)] == \
            [None, small, small, mid, mid, mid, mid]
        assert A.decode_tile_for(32, 4, 128, 16) is None  # another layout: untouched
        with pytest.raises(KernelLimitError, match="not candidates") as e:
            A.set_decode_tiles(32, 4, 128, {1: dict(BLOCK_M=16, num_warps=4, num_stages=2)})
        assert "groups of 8" in str(e.value)
        assert A.decode_tile_for(32, 4, 128, 1) is None
    finally:
        A.clear_decode_tiles()


@pytest.mark.parametrize("g,bm", [(1, 16), (4, 16), (8, 16), (12, 16), (16, 16), (20, 32), (32, 32), (48, None)])
def test_the_choice_times_the_fixed_tile_flat_and_the_fewest_one_warp_rows_nested_in_two_stages_flat_in_two_and_three(
        g, bm):
    tiles = A.chooser_tiles(g)
    one_warp = [dict(BLOCK_M=bm, num_warps=1, num_stages=2), dict(BLOCK_M=bm, num_warps=1, num_stages=2, loop="flat"),
                dict(BLOCK_M=bm, num_warps=1, num_stages=3, loop="flat")] if bm else []
    assert tiles == [dict(A.candidate_tiles(g)[0], loop="flat"), *one_warp]
    assert all(t in A.candidate_tiles(g) for t in tiles)


@pytest.mark.parametrize("b,hkv,rule,splits", [(1, 4, 66, [66, 132, 264]), (16, 4, 5, [4, 5, 8, 10, 20]),
                                               (64, 4, 2, [1, 2, 4, 8]), (64, 6, 1, [1, 2, 4, 8]),
                                               (128, 4, 1, [1]), (256, 4, 1, [1])])
def test_decode_variants_are_the_fixed_tile_as_launched_then_candidates_with_the_choice_splits(b, hkv, rule, splits):
    """132 SMs (an H200): the split rule reaches 264 programs. The choice times the rule's split, 2x and 4x
    it, and the powers of two up to 8 that keep a program on every SM, at most the 320 segments of 40,960
    keys; where the rule does not split, only while the state buffer stays within the bound (group 8:
    b 64 at 6 KV heads holds 511 MB, b 128 at 4 KV heads 681 MB)."""
    assert A.split_rule(b * hkv, 320, 264) == rule
    assert A.choice_splits(8 * hkv, hkv, b, 40960, 264) == splits
    v = A.decode_variants(8 * hkv, hkv, b, 40960, 264)
    fixed, others = A.candidate_tiles(8)[0], A.chooser_tiles(8)
    more = [s for s in splits if s != rule]
    assert v[0] is None and v[1:] == [dict(fixed, split=s) for s in more] + [
        x for t in others for x in [t] + [dict(t, split=s) for s in more]]
    assert A.tile_label(v[0]) == "fixed" and A.tile_label(v[-1]).startswith("16 rows w1 s3 flat")
    assert len(v) == 1 + len(more) + len(others) * (1 + len(more))
    assert A.decode_variants(8 * hkv, hkv, b, 100, 264)[1:] == others  # one segment: nothing to split


@pytest.mark.parametrize("hq,hkv", [(32, 4), (24, 6), (64, 4), (40, 2), (96, 8), (4, 4)])
@pytest.mark.parametrize("b", [1, 2, 3, 5, 16, 24, 64, 100, 128, 256])
@pytest.mark.parametrize("max_kv_len", [100, 1000, 40960, 262144])
@pytest.mark.parametrize("sms", [78, 132])
def test_choice_splits_keep_every_sm_busy_and_the_state_buffer_bounded(hq, hkv, b, max_kv_len, sms):
    fill, nseg = 2 * sms, -(-max_kv_len // A.SEG)
    rule = A.split_rule(b * hkv, nseg, fill)
    splits = A.choice_splits(hq, hkv, b, max_kv_len, fill)
    assert splits == sorted(set(splits)) and rule in splits and all(1 <= s <= max(nseg, 1) for s in splits)
    assert all(s in (rule, 2 * rule, 4 * rule, nseg) or (s in A.CHOICE_SPLITS and b * hkv * s >= sms)
               for s in splits)
    assert all(b * hkv * s >= sms or s >= rule for s in splits)  # never fewer programs than SMs, unless the rule's
    if rule == 1 and splits != [1]:
        assert A.split_state_bytes(hq, b, max_kv_len, 128) <= A.SPLIT_STATE_BYTES


def test_a_chosen_split_is_installed_and_a_bad_one_refused():
    t = dict(A.chooser_tiles(4)[0], split=4)
    try:
        A.set_decode_tiles(24, 6, 128, {8: t, 64: dict(A.candidate_tiles(4)[0], split=2)})
        assert A.decode_tile_for(24, 6, 128, 5) == t
        assert A.decode_tile_for(24, 6, 128, 64) == dict(A.candidate_tiles(4)[0], split=2)
        assert A.decode_tile_for(24, 6, 128, 65) == A.candidate_tiles(4)[0]  # beyond the timed batches: the rule splits
        A.set_decode_tiles(24, 6, 128, {8: t})
        assert A.decode_tile_for(24, 6, 128, 9) == A.chooser_tiles(4)[0]
        for bad in (dict(t, split=0), dict(t, split=True), dict(t, split=2.0)):
            with pytest.raises(KernelLimitError, match="not candidates"):
                A.set_decode_tiles(24, 6, 128, {8: bad})
    finally:
        A.clear_decode_tiles()


@pytest.mark.parametrize("bs,timed", [([1, 2, 4, 8, 12, 16, 24, 256], [1, 2, 4, 8, 16, 32, 64, 128, 256]),
                                      ([1, 2, 3, 48], [1, 2, 4, 8, 16, 32, 48]), ([1], [1]), ([], [])])
def test_timed_batches_cover_every_captured_batch(bs, timed):
    assert cuda_graph.timed_batches(bs) == timed
    assert all(any(t >= b for t in timed) for b in bs)


CODE = FAKE_MODEL_RUNNER + r"""
calls = []
att.choose_decode_tiles = lambda hq, hkv, d, batches, k, v, width: (
    calls.append((hq, hkv, d, batches, tuple(k.shape), tuple(v.shape), width)) or {b: None for b in batches})

class Runner:
    capture_bs, model_runner = [1, 2, 24], MR()

import os
os.environ['TRUE_ON_POLICY_DECODE_TILES'] = 'fixed'
cuda_graph._make_capture(lambda self: None)(Runner())
assert calls == [] and 'decode_tiles' not in cuda_graph.CAPTURED, calls  # 'fixed': no timing, the fixed tile
os.environ['TRUE_ON_POLICY_DECODE_TILES'] = ''
cuda_graph._make_capture(lambda self: None)(Runner())
assert calls == [(8, 2, 128, [1, 2, 4, 8, 16, 24], (10, 2, 128), (10, 2, 128), 40960),
                 (16, 4, 64, [1, 2, 4, 8, 16, 24], (10, 4, 64), (10, 4, 64), 40960)], calls
assert cuda_graph.CAPTURED['decode_tiles'][0] == {'heads': [8, 2, 128], 'tiles': {str(b): None for b in calls[0][3]}}
class Stage:  # a pipeline stage whose layers hold no attention: nothing to time, and the capture goes on
    capture_bs, model_runner = [1, 2], type('M', (), {'model': torch.nn.Linear(2, 2), 'token_to_kv_pool': Pool(),
                                                      'req_to_token_pool': MR.req_to_token_pool})()
cuda_graph._make_capture(lambda self: None)(Stage())
assert len(calls) == 2 and cuda_graph.CAPTURED['decode_tiles'] == [] and cuda_graph.CAPTURED['captured'], calls
print('ok')
"""


def test_the_decode_capture_chooses_tiles_for_every_head_layout_unless_fixed():
    r = run_py(CODE, env_extra={"TRUE_ON_POLICY_DECODE_TILES": ""})
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


@pytest.mark.parametrize("hq,tq,max_kv_len", [(96, 100, 262144), (96, 8, 262144), (32, 500, 40960), (64, 2, 40960)])
def test_a_prefill_splits_only_where_its_state_fits(hq, tq, max_kv_len):
    nseg = -(-max_kv_len // A.SEG)
    fits = A.split_state_bytes(hq, tq, max_kv_len, 128) <= A.SPLIT_STATE_BYTES
    assert A.prefill_split(4, nseg, tq, hq, 128) == (4 if fits else 1)
    assert A.prefill_split(1, nseg, tq, hq, 128) == 1
    assert (hq, tq, max_kv_len) != (96, 100, 262144) or not fits  # a small Coder-480B prefill at its context
