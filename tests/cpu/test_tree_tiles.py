"""v1's tree down projection above the decode path takes the tile timed fastest at start-up for its layer's shape
(``kernels.matmul.choose_tree_tiles``, run by ``patches/cuda_graph.py`` before the first CUDA-graph capture unless
``TRUE_ON_POLICY_TREE_TILE=fixed``), by the rows per expert (``seg_prefill_tile``); ROW_SEG where nothing was timed,
without slots, and under TREE_FIXED. Where a segment is too wide for ROW_SEG's stages, each candidate at the most
stages that fit, against the flat loop that runs there (``wide_prefill_tile``). The timing itself runs on the GPU
(tests/gpu/test_kernels_gpu.py: test_the_tree_tile_choice_keeps_the_bits and
test_the_wide_segment_choice_keeps_the_bits, which also check the bits); here a timer stands in for it. The
candidates hold every committed sweep's fastest tile, so the choice can reach it."""

import json

import pytest
import torch
from helpers import FAKE_MODEL_RUNNER, ROOT, run_py
from true_on_policy.kernels import attention, seg_tree
from true_on_policy.kernels import matmul as mm
from true_on_policy.patches import cuda_graph

SWEEPS = ["bench-tree-down-a22b_h100.json", "bench-tree-down-a3b48.json"]  # benchmarks/gemm_sweep.py --gemms down
WIDTHS = [64, 96, 128, 192]  # the segments of 8 of h1536e256k6, 30B-A3B, h3072e64k4 and 235B-A22B
WIDE = [256, 320, 384]  # too wide for ROW_SEG's 3 stages: 2048 / 8, Coder-480B-A35B's 2560 / 8, 30B-A3B's 768 / 2


@pytest.fixture
def on_gpu(monkeypatch):
    """The dispatch as on a GPU (the interpreter keeps the flat loop), no choice installed."""
    monkeypatch.setattr(mm, "INTERPRETED", False)
    monkeypatch.setattr(mm, "TREE_CHOSEN", {})
    monkeypatch.setattr(mm, "TREE_FIXED", False)


def _timer(fastest_by_rows, calls=None):
    """A stand-in for ``time_tree_tiles``: 1.0 ms for each candidate, 0.5 for the one named per rows timed."""
    def timer(w, segments, rows, cands):
        if calls is not None:
            calls.append((tuple(w.shape), segments, rows, list(cands)))
        return [0.5 if c == fastest_by_rows.get(rows) else 1.0 for c in cands]
    return timer


@pytest.mark.parametrize("seg", WIDTHS)
def test_the_candidates_split_the_segment_fit_a_block_and_start_with_row_seg(seg):
    cands = mm.tree_candidates(seg)
    assert cands[0] is mm.ROW_SEG and len(cands) == len(mm.TREE_CANDIDATES)
    assert all(seg_tree.fits(seg, c["BK"]) and seg_tree.fits_block(seg, c) for c in cands)
    assert all(c in mm.candidate_tiles("seg_tree") and mm.ALIGN % c["BLOCK_M"] == 0 for c in cands)


@pytest.mark.parametrize("seg", WIDE)
def test_where_a_segment_is_wide_each_candidate_takes_the_most_stages_that_fit(seg):
    cands = mm.tree_candidates(seg)
    assert cands and not seg_tree.smem_ok(seg, mm.ROW_SEG)
    for c in cands:
        own = next(t for t in mm.TREE_CANDIDATES if dict(t, num_stages=c["num_stages"]) == c)
        assert seg_tree.fits(seg, c["BK"]) and seg_tree.fits_block(seg, c) and 2 <= c["num_stages"] <= own["num_stages"]
        more = dict(c, num_stages=c["num_stages"] + 1)
        assert c["num_stages"] == own["num_stages"] or not seg_tree.fits_block(seg, more)
        assert c in mm.candidate_tiles("seg_tree") and mm.ALIGN % c["BLOCK_M"] == 0
    left_out = [t for t in mm.TREE_CANDIDATES if all(dict(t, num_stages=c["num_stages"]) != c for c in cands)]
    assert all(not seg_tree.fits_block(seg, dict(t, num_stages=2)) for t in left_out), left_out
    assert mm.tree_candidates(640) == []  # not even 2 stages of any fit


def test_a_candidate_whose_stages_overfill_a_block_is_left_out():
    wide = dict(BLOCK_M=128, BLOCK_N=128, BK=64, num_warps=8, num_stages=3)  # 3 x 256 x 192 x 2 bytes: 288 KB
    assert not seg_tree.fits_block(192, wide) and seg_tree.fits_block(192, mm.TREE_CANDIDATES[3])
    assert mm.TREE_BUCKETS[-1][0] is None and [b for b, _ in mm.TREE_BUCKETS[:-1]] == sorted(b for b, _ in mm.TREE_BUCKETS[:-1])


def test_the_choice_takes_each_bucket_s_fastest_and_the_call_its_bucket_s(on_gpu, monkeypatch):
    w = torch.empty(128, 4096, 1536)  # 235B-A22B's down projection, 8 segments of 192
    small, large = mm.TREE_CANDIDATES[1], mm.TREE_CANDIDATES[3]
    calls = []
    chosen = mm.choose_tree_tiles(w, 8, timer=_timer({32: small, 128: large, 256: large}, calls))
    assert [c[2] for c in calls] == [rows for _, rows in mm.TREE_BUCKETS]
    assert all(c[0] == (128, 4096, 1536) and c[1] == 8 and c[3] == mm.tree_candidates(192) for c in calls)
    assert chosen == {"32": small, "128": large, "256": large}
    for tokens, want in ((512, small), (1024, large), (8192, large)):  # 32, 64 and 512 rows per expert
        assert mm.seg_prefill_tile(192, 4096, tokens * 8, 128) == want, tokens
    assert mm.seg_prefill_tile(192, 4096, None, 128) is mm.ROW_SEG  # no slots
    assert mm.seg_prefill_tile(192, 2048, 4096, 128) is mm.ROW_SEG  # another shape: nothing timed for it
    assert mm.seg_prefill_tile(96, 4096, 4096, 128) is mm.ROW_SEG
    monkeypatch.setattr(mm, "TREE_FIXED", True)
    assert mm.seg_prefill_tile(192, 4096, 8192 * 8, 128) is mm.ROW_SEG


def test_row_seg_stays_unless_a_candidate_beats_it_by_the_margin(on_gpu):
    w = torch.empty(128, 2048, 768)

    def timer(w, segments, rows, cands):  # every other candidate a little faster, within the margin
        return [1.0] + [1.0 - attention.CHOICE_MARGIN / 2] * (len(cands) - 1)
    assert set(map(id, mm.choose_tree_tiles(w, 8, timer=timer).values())) == {id(mm.ROW_SEG)}


def test_where_a_segment_is_wide_the_choice_times_the_flat_loop_first_and_keeps_it_unless_beaten(on_gpu, monkeypatch):
    w = torch.empty(160, 6144, 2560)  # Coder-480B-A35B's down projection, 8 segments of 320
    flat, cands = mm._tiles(8, True, 2560), mm.tree_candidates(320)
    calls = []
    chosen = mm.choose_tree_tiles(w, 8, timer=_timer({128: cands[2], 256: cands[1]}, calls))
    assert all(c[3] == [flat, *cands] for c in calls) and [c[2] for c in calls] == [r for _, r in mm.TREE_BUCKETS]
    assert chosen == {"32": flat, "128": cands[2], "256": cands[1]}
    assert mm.wide_prefill_tile(2560, 8, 6144, 512 * 8, 160) is None  # 25.6 rows per expert: the flat loop's bucket
    assert mm.wide_prefill_tile(2560, 8, 6144, 2048 * 8, 160) == cands[2]
    assert mm.wide_prefill_tile(2560, 8, 6144, 8192 * 8, 160) == cands[1]
    assert mm.wide_prefill_tile(2560, 8, 6144, None, 160) is None  # no slots
    assert mm.wide_prefill_tile(2560, 8, 4096, 8192 * 8, 160) is None  # another shape: nothing timed for it
    monkeypatch.setattr(mm, "TREE_FIXED", True)
    assert mm.wide_prefill_tile(2560, 8, 6144, 8192 * 8, 160) is None


def test_where_a_segment_is_wide_the_flat_loop_stays_unless_beaten_by_the_margin(on_gpu):
    def timer(w, segments, rows, cands):
        return [1.0] + [1.0 - attention.CHOICE_MARGIN / 2] * (len(cands) - 1)
    chosen = mm.choose_tree_tiles(torch.empty(160, 6144, 2560), 8, timer=timer)
    assert chosen and all(c == mm._tiles(8, True, 2560) for c in chosen.values())
    assert mm.wide_prefill_tile(2560, 8, 6144, 8192 * 8, 160) is None


@pytest.mark.parametrize("k,segments", [(5120, 8), (768, 1), (770, 8)])
def test_nothing_is_timed_where_the_tree_loop_does_not_run(on_gpu, k, segments):
    calls = []
    assert mm.choose_tree_tiles(torch.empty(4, 64, k), segments, timer=_timer({}, calls)) == {} and calls == []
    assert mm.TREE_CHOSEN == {}


def test_the_interpreter_times_nothing(monkeypatch):
    monkeypatch.setattr(mm, "INTERPRETED", True)
    assert mm.choose_tree_tiles(torch.empty(4, 64, 768), 8, timer=_timer({})) == {}


def _label(cfg):
    return f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']}x{cfg['BK']} w{cfg['num_warps']} s{cfg['num_stages']}"


@pytest.mark.parametrize("name", SWEEPS)
def test_the_candidates_hold_every_committed_sweep_s_fastest_tile(name):
    """At every token count of the sweep, a candidate is within 4 % of the fastest tile by pointer loads in the
    rollout's order of programs (each with the reference's bits), so the choice can reach it."""
    doc = json.loads((ROOT / "evidence" / name).read_text())
    seg = doc["moe_shape"]["inter"] // 8
    labels = {f"seg_tree {_label(c)} group {mm.MOE_GROUP_M}" for c in mm.tree_candidates(seg)}
    by_tokens = {}
    for r in doc["rows"]:
        if r["form"].startswith("seg_tree ") and " order " not in r["form"] and r.get("ms"):
            assert r["same_bits"], r
            by_tokens.setdefault(r["tokens"], {})[r["form"]] = r["ms"]
    assert len(by_tokens) >= 4
    for tokens, rows in by_tokens.items():
        ours = min(ms for form, ms in rows.items() if form in labels)
        assert ours <= 1.04 * min(rows.values()), (name, tokens, ours, min(rows.values()))


class _Block(torch.nn.Module):
    def __init__(self, shape, tp_size=1):
        super().__init__()
        self.experts = type("Experts", (), {"w2_weight": torch.empty(shape)})()
        self.tp_size = tp_size


def test_the_patch_times_each_moe_shape_once_and_records_an_out_of_memory(monkeypatch):
    from true_on_policy.kernels.tree_reduce import set_tree_width

    seen = []

    def choose(w, segments):
        seen.append((tuple(w.shape), segments))
        if w.shape[0] == 2:
            raise torch.cuda.OutOfMemoryError("no room")
        return {"32": mm.ROW_SEG}
    monkeypatch.setattr(mm, "choose_tree_tiles", choose)
    model = torch.nn.ModuleList([_Block((4, 64, 768)), _Block((4, 64, 768)), _Block((2, 64, 384), tp_size=2)])
    runner = type("MR", (), {"model": model})()
    with set_tree_width(8):
        got = cuda_graph.choose_tree_tiles(runner, block_type=_Block)
    assert seen == [((4, 64, 768), 8), ((2, 64, 384), 4)]  # the two layers of one shape timed once; TP 2: 4 segments
    assert got[0] == {"shape": [4, 64, 768], "segments": 8, "tiles": {"32": mm.ROW_SEG}}
    assert got[1]["shape"] == [2, 64, 384] and "out of GPU memory" in got[1]["error"] and "tiles" not in got[1]
    seen.clear()
    with set_tree_width(1):  # the flat contract: nothing to time, at any TP
        assert cuda_graph.choose_tree_tiles(runner, block_type=_Block) == [] and seen == []


CAPTURE = FAKE_MODEL_RUNNER + r"""
import os
calls = []
att.choose_decode_tiles = lambda hq, hkv, d, batches, k, v, width: {b: None for b in batches}
cuda_graph.choose_tree_tiles = lambda model_runner: calls.append(model_runner) or [{'tiles': 'chosen'}]

class Runner:
    capture_bs, capture_num_tokens, model_runner = [1, 2, 24], [4, 8], MR()

os.environ['TRUE_ON_POLICY_TREE_TILE'] = 'fixed'
cuda_graph._make_capture(lambda self: None)(Runner())
assert calls == [] and 'tree_tiles' not in cuda_graph.CAPTURED, calls  # 'fixed': no timing
os.environ['TRUE_ON_POLICY_TREE_TILE'] = ''
cuda_graph._make_capture(lambda self: None, cuda_graph.PREFILL_CAPTURE)(Runner())  # the first capture of either
assert len(calls) == 1 and cuda_graph.CAPTURED['tree_tiles'] == [{'tiles': 'chosen'}], calls
assert isinstance(cuda_graph.CAPTURED['tree_tiles_s'], float)
cuda_graph._make_capture(lambda self: None)(Runner())  # the decode capture after it: no second timing
assert len(calls) == 1, calls
print('ok')
"""


def test_the_first_graph_capture_chooses_the_tree_tiles_unless_fixed():
    r = run_py(CAPTURE, env_extra={"TRUE_ON_POLICY_TREE_TILE": "fixed"})
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


TIMING = r"""
import torch
from true_on_policy.kernels import attention, matmul as mm

ran = []
def time_graphs(calls, device, rounds, reps):  # each call once, interpreted; the second candidate "fastest"
    out = []
    for i, call in enumerate(calls):
        call()
        ran.append(i)
        out.append(2.0 if i != 1 else 1.0)
    return out
attention.time_graphs = time_graphs
w = (torch.randn(4, 64, 128, generator=torch.Generator().manual_seed(0)) * 0.05).bfloat16()
mm.INTERPRETED = False  # the dispatch as on a GPU; the launches stay interpreted
chosen = mm.choose_tree_tiles(w, 2)
cands = mm.tree_candidates(64)
assert ran == list(range(len(cands))) * len(mm.TREE_BUCKETS), ran
assert chosen == {str(rows): cands[1] for _, rows in mm.TREE_BUCKETS}, chosen
assert mm.seg_prefill_tile(64, 64, 160, 4) == cands[1]
print('ok')
"""


def test_the_timing_launches_every_candidate_as_the_rollout_does_interpreted():
    """``time_tree_tiles`` builds the table the rollout builds (``moe.align``) and launches every candidate at each
    bucket's rows through ``seg_tree.launch`` (interpreted here; the CUDA-graph timing is the GPU's)."""
    r = run_py(TIMING, env_extra={"TRITON_INTERPRET": "1"})
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


@pytest.mark.parametrize("k,segments", [(2560, 8), (1280, 4)])  # Coder-480B-A35B's down projection at TP 1 and 2
def test_at_decode_a_wide_segment_runs_seg_tree_in_a_decode_tile_whose_stages_fit(on_gpu, k, segments):
    for t in (1, 4, 16, 64):
        assert mm.grouped_decode(t, t * 8, 160) and mm.wide_decode(t, t * 8, 160, k, segments)
        cfg = mm.seg_tiles(t, t * 8, 160, 6144, k, segments, 132)
        assert cfg in mm.SEG_GRID.values() and seg_tree.smem_ok(320, cfg) and not seg_tree.smem_ok(320, mm.ROW_SEG)
    assert not mm.wide_decode(512, 512 * 8, 160, k, segments)  # above the decode path: the flat loop or the choice
    assert not mm.wide_decode(16, None, 160, k, segments)  # no slots
    assert not mm.wide_decode(16, 128, 160, k, 1)  # no tree


def test_at_decode_a_segment_row_seg_fits_keeps_seg_path_and_the_interpreter_the_flat_loop(on_gpu, monkeypatch):
    assert mm.seg_path(768, 8) and not mm.wide_decode(16, 128, 128, 768, 8)
    monkeypatch.setattr(mm, "INTERPRETED", True)
    assert not mm.wide_decode(16, 128, 160, 2560, 8)


def test_grouped_matmul_launches_seg_tree_at_decode_where_a_segment_is_wide(on_gpu, monkeypatch):
    from true_on_policy.kernels.moe import align_reference as align

    calls = []
    monkeypatch.setattr(seg_tree, "launch", lambda *a, **kw: calls.append((a[5], a[7], kw["subtiles"])) or a[2])
    monkeypatch.setattr(mm, "_launch", lambda *a, **kw: calls.append(("flat", a[7])) or a[2])
    g = torch.Generator().manual_seed(0)
    for t in (4, 512):
        ids = torch.rand(t, 160, generator=g).argsort(dim=1)[:, :8].int()
        rows, be, _ = align(ids, 0, 160)
        own = torch.where(rows >= 0, torch.arange(rows.shape[0]), -1)  # the down GEMM's table (``moe.align``)
        x, w = torch.zeros(own.shape[0], 2560, dtype=torch.bfloat16), torch.zeros(160, 64, 2560, dtype=torch.bfloat16)
        mm.grouped_matmul(x, w, own, be, torch.float32, 8, tree=True, tokens=t, slots=t * 8)
    cfg = mm.seg_tiles(4, 32, 160, 64, 2560, 8, mm.sm_count(x))
    assert calls == [(mm.used_blocks(32, 160) * mm.ALIGN, cfg, mm.ALIGN // cfg["BLOCK_M"]), ("flat", mm.ROW_FLAT)]
