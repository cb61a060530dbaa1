"""The scheduler guard (patches/scheduler_guard.py) on SGLang 0.5.17's own Req, FINISH_ABORT and
prepare_abort, with a stand-in scheduler: a KernelLimitError or PatchError in a forward aborts
that batch's requests with HTTP 500, frees their KV without inserting it into the radix cache,
ends a chunked prefill, streams the finish, and the batch's result is skipped downstream; any other
error still propagates, and so does every error under pipeline parallel. The same path on a GPU
server is tests/gpu/test_guard_gpu.py."""

from http import HTTPStatus
from types import SimpleNamespace

import pytest

sglang = pytest.importorskip("sglang")

from sglang.srt.managers.schedule_batch import FINISH_ABORT, Req  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from true_on_policy.kernels.limits import KernelLimitError  # noqa: E402
from true_on_policy.patches import scheduler_guard as g  # noqa: E402

from true_on_policy.patching import PatchError  # noqa: E402

NO_FAULT = g.parse_fault(None)


def _req(rid, n_in, n_out=0, pool_idx=0):
    r = Req(rid, "", list(range(1, n_in + 1)), SamplingParams(max_new_tokens=8))
    r.output_ids.extend(range(n_out))
    r.req_pool_idx = pool_idx
    return r


class _Scheduler:
    def __init__(self, pp_size=1, chunked_req=None):
        self.ps = SimpleNamespace(pp_size=pp_size)
        self.tree_cache = object()
        self.chunked_req = chunked_req
        self.streamed = []
        self.output_streamer = SimpleNamespace(stream_output=lambda reqs, lp: self.streamed.append((list(reqs), lp)))


@pytest.fixture
def released(monkeypatch):
    calls = []
    import sglang.srt.mem_cache.common as common

    monkeypatch.setattr(common, "release_kv_cache",
                        lambda req, tree, is_insert=True: calls.append((req.rid, tree, is_insert)))
    return calls


def _raising(error):
    def run_batch(self, batch, *a, **k):
        raise error
    return run_batch


def test_kernel_limit_in_a_forward_fails_that_batch_only(released):
    chunked = _req("c", 300)
    reqs = [_req("a", 10), _req("b", 20, pool_idx=1), chunked]
    batch = SimpleNamespace(reqs=reqs, forward_mode=ForwardMode.EXTEND)
    s = _Scheduler(chunked_req=chunked)
    result = g._make_run_batch(_raising(KernelLimitError("attention: head_dim 96 is not supported")), NO_FAULT)(s, batch)
    assert isinstance(result, g.FailedBatch) and g.failed(result)
    for r in reqs:
        assert isinstance(r.finished_reason, FINISH_ABORT) and r.finished()
        fr = r.finished_reason.to_json()
        assert fr["status_code"] == HTTPStatus.INTERNAL_SERVER_ERROR, fr
        assert "head_dim 96 is not supported" in fr["message"] and "serves on" in fr["message"], fr
    assert released == [(r.rid, s.tree_cache, False) for r in reqs]  # never inserted into the radix cache
    assert s.chunked_req is None
    assert s.streamed == [(reqs, False)]
    seen = []
    process = g._make_process(lambda self, b, res: seen.append(res))
    launch = g._make_launch_sample(lambda self, res, b: seen.append(res))
    assert process(s, batch, result) is None and launch(s, result, batch) is None and seen == []
    ok = SimpleNamespace(delay_sample_func=None)
    process(s, batch, ok)
    assert seen == [ok]  # a normal result goes through


def test_patch_error_is_guarded_too(released):
    batch = SimpleNamespace(reqs=[_req("a", 5)], forward_mode=ForwardMode.DECODE)
    s = _Scheduler()
    out = g._make_run_batch(_raising(PatchError("speculative extend is not in the contract")), NO_FAULT)(s, batch)
    assert g.failed(out) and "speculative extend" in batch.reqs[0].finished_reason.to_json()["message"]
    assert s.chunked_req is None and len(released) == 1


def test_other_errors_and_pipeline_parallel_still_stop_the_server(released):
    batch = SimpleNamespace(reqs=[_req("a", 5)], forward_mode=ForwardMode.DECODE)
    with pytest.raises(RuntimeError, match="CUDA error"):
        g._make_run_batch(_raising(RuntimeError("CUDA error: an illegal memory access")), NO_FAULT)(_Scheduler(), batch)
    with pytest.raises(KernelLimitError):
        g._make_run_batch(_raising(KernelLimitError("x")), NO_FAULT)(_Scheduler(pp_size=2), batch)
    launch = g._make_launch_sample(lambda self, res, b: (_ for _ in ()).throw(KernelLimitError("y")))
    with pytest.raises(KernelLimitError):
        launch(_Scheduler(pp_size=2), SimpleNamespace(delay_sample_func=object()), batch)
    assert not batch.reqs[0].finished() and released == []


def test_deferred_sampling_failure_marks_the_queued_result(released):
    reqs = [_req("a", 5), _req("b", 6, pool_idx=None)]  # b holds no KV yet: nothing to release
    batch = SimpleNamespace(reqs=reqs, forward_mode=ForwardMode.DECODE)
    s = _Scheduler()
    result = SimpleNamespace(delay_sample_func=object())

    def sample(self, res, b):
        raise KernelLimitError("token_logprobs: token id out of the vocabulary")

    assert g._make_launch_sample(sample)(s, result, batch) is None
    assert g.failed(result) and all(r.finished() for r in reqs)
    assert released == [("a", s.tree_cache, False)]
    seen = []
    assert g._make_process(lambda self, b, res: seen.append(res))(s, batch, result) is None and seen == []


def test_a_finished_request_is_not_released_again(released):
    done = _req("done", 5)
    done.finished_reason = FINISH_ABORT("earlier")
    live = _req("live", 5)
    s = _Scheduler()
    g._make_run_batch(_raising(KernelLimitError("z")), NO_FAULT)(s, SimpleNamespace(reqs=[done, live],
                                                                                   forward_mode=ForwardMode.DECODE))
    assert released == [("live", s.tree_cache, False)] and done.finished_reason.to_json()["message"] == "earlier"


def test_test_fault_spec_and_injection(released):
    assert g.parse_fault("prefill:77, decode:91:5") == {"prefill": {77}, "decode": {(91, 5)}}
    assert g.parse_fault("") == NO_FAULT
    for bad in ("prefill", "prefill:x", "decode:91", "oops:1"):
        with pytest.raises(ValueError, match="TRUE_ON_POLICY_TEST_KERNEL_LIMIT"):
            g.parse_fault(bad)
    fault = g.parse_fault("prefill:77,decode:91:5")
    ran = []
    run = g._make_run_batch(lambda self, b: ran.append(b) or "result", fault)
    s = _Scheduler()
    plain = SimpleNamespace(reqs=[_req("a", 76), _req("b", 91, n_out=4)], forward_mode=ForwardMode.DECODE)
    assert run(s, plain) == "result"
    assert run(s, SimpleNamespace(reqs=[_req("p", 77)], forward_mode=ForwardMode.DECODE)) == "result"  # not a prefill
    hit = SimpleNamespace(reqs=[_req("a", 10), _req("p", 77)], forward_mode=ForwardMode.EXTEND)
    out = run(s, hit)
    assert g.failed(out) and "test fault: prefill of a 77-token prompt" in out.message
    assert out.discarded == "result"  # the forward's own result lives until the failed one is processed
    assert all(r.finished() for r in hit.reqs) and len(ran) == 3  # the forward ran first, then the fault
    dec = SimpleNamespace(reqs=[_req("d", 91, n_out=5)], forward_mode=ForwardMode.DECODE)
    assert "decode of a 91-token prompt with 5 tokens out" in run(s, dec).message


def test_kernel_argument_checks_raise_kernel_limit_errors():
    import torch
    from true_on_policy.kernels.rmsnorm import rmsnorm

    with pytest.raises(KernelLimitError, match="rmsnorm: x must be"):
        rmsnorm(torch.zeros(2, 3, dtype=torch.bfloat16), torch.ones(4, dtype=torch.bfloat16), 1e-6)
    assert issubclass(KernelLimitError, ValueError)  # callers that caught ValueError still do


@pytest.fixture
def radix(monkeypatch):
    """SGLang's own RadixCache and release_kv_cache over a recording allocator and a 4 x 64 token table."""
    from array import array

    import sglang.srt.managers.schedule_batch as sb
    import sglang.srt.mem_cache.common as common
    import torch
    from sglang.srt.managers.schedule_batch import ReqKvInfo
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.radix_cache import RadixCache

    # the process-wide config SGLang publishes at launch; what these two reads need, as a server has it
    monkeypatch.setattr(sb, "get_serving", lambda: SimpleNamespace(strip_thinking_cache=False))
    monkeypatch.setattr(common, "get_serving", lambda: SimpleNamespace(strip_thinking_cache=False))
    monkeypatch.setattr(common, "get_spec", lambda: SimpleNamespace(speculative_algorithm=None))

    class Allocator:
        page_size, device = 1, "cpu"

        def __init__(self):
            self.freed = []

        def free(self, idx):
            self.freed += idx.tolist()

        def free_segment(self, idx, *, start_pos):
            self.freed += idx.tolist()

        def free_segments(self, segments):
            for idx, start in segments:
                self.free_segment(idx, start_pos=start)

    class Pool:
        req_to_token = torch.arange(1000, 1256, dtype=torch.int32).view(4, 64)

        def free(self, req):
            req.req_pool_idx = None

    alloc = Allocator()
    tree = RadixCache(CacheInitParams(disable=False, req_to_token_pool=Pool(), token_to_kv_pool_allocator=alloc,
                                      page_size=1))

    def make(n_in, n_out, committed, pool_idx=2):
        r = Req("r", "", array("q", range(1, n_in + 1)), SamplingParams(max_new_tokens=8))
        r.output_ids.extend(range(7, 7 + n_out))
        r.req_pool_idx, r.kv_committed_len = pool_idx, committed
        r.kv = ReqKvInfo(kv_allocated_len=committed, swa_evicted_seqlen=0)
        r.last_node = tree.root_node
        tree.inc_lock_ref(tree.root_node)
        return r

    return SimpleNamespace(tree=tree, alloc=alloc, make=make, release=common.release_kv_cache,
                           row=lambda i, n: list(range(1000 + 64 * i, 1000 + 64 * i + n)))


def test_a_decode_failed_under_the_overlap_schedule_frees_every_committed_slot(radix):
    """Overlap: the failing decode batch committed one slot more than the request has token ids (the
    previous batch's token is not appended yet). SGLang's release alone leaks that slot, which its
    idle memory check turns into a stopped server; release_lagging frees all 16, once each."""
    r = radix.make(10, 5, committed=16)
    radix.release(r, radix.tree, is_insert=False)
    assert sorted(radix.alloc.freed) == radix.row(2, 15)  # the leak this guards against: slot 1143 stays taken
    radix.alloc.freed.clear()
    r = radix.make(10, 5, committed=16)
    assert g.release_lagging(r, radix.tree, radix.release) == 1
    assert sorted(radix.alloc.freed) == radix.row(2, 16) and len(radix.alloc.freed) == 16
    assert list(r.output_ids) == [7, 8, 9, 10, 11] and r.req_pool_idx is None  # the stand-ins are gone again


@pytest.mark.parametrize("n_out,committed", [(0, 10), (5, 15), (0, 6)])  # prefill; decode in step; a chunk
def test_without_a_lag_the_release_is_sglangs_own(radix, n_out, committed):
    r = radix.make(10, n_out, committed=committed)
    assert g.release_lagging(r, radix.tree, radix.release) == 0
    assert sorted(radix.alloc.freed) == radix.row(2, committed)
