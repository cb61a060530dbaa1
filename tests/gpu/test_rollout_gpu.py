"""Rollout side on one GPU, items 1-7 of the rollout issue (small sample; the full sample is
``python -m true_on_policy.harness.acceptance --out ...`` and ``python -m true_on_policy.harness.parity``).

Chain: rollout (graphs, chunked prefill 128) == patched trainer -> alone == batch of 32 ==
sent while 31 others decode (the run shows they were decoding) -> radix hit (cached tokens > 0)
== cold -> chunk 128 == chunked prefill off (prompts longer than 128) -> graph == eager -> 100
repeats, one output -> overlay off == no plugin. Item 7 (throughput) is recorded, not asserted:
a timed assertion in a test fails on a busy machine and passes on a slow overlay; only that both
sides decoded the whole workload is asserted."""

import pytest

pytestmark = pytest.mark.gpu


def test_rollout_acceptance_small(tiny_cache, gpu_evidence):
    from true_on_policy.harness.acceptance import run

    ev = run("embedded", small=True)
    items = ev["items"]
    gpu_evidence.append({"test": "rollout_acceptance_small", "items": items, "cuda_graph": ev["cuda_graph"],
                         "server_args": ev["server_args"]})
    for t in (1.0, 0.7):
        one = items[f"1_rollout_eq_trainer_t{t}"]
        assert one["max_abs_diff"] == 0.0 and one["exact_fraction"] == 1.0, one
        graph = items[f"4_graph_eq_eager_t{t}"]
        assert graph["bitwise"] and graph["disable_cuda_graph"] == {"tpo": False, "eager": True}, graph
        chunked = items[f"3_chunked_eq_unsplit_t{t}"]
        assert chunked["bitwise"] and chunked["chunk_sizes"] == {"tpo": 128, "unsplit": -1}, chunked
        assert chunked["prompts_longer_than_chunk"] > 0, chunked  # the prefill really split
        assert items[f"6_inert_t{t}"]["bitwise"], items[f"6_inert_t{t}"]
    assert items["2_alone_eq_batch32"]["bitwise"], items["2_alone_eq_batch32"]
    inter = items["2_alone_eq_interleaved"]
    assert inter["bitwise"] and inter["joined_running_decode"], inter
    radix = items["3_radix_hit_eq_cold"]
    assert radix["bitwise"] and radix["hit"] and radix["cached_tokens_warm"] > 0, radix
    assert items["5_repeats_unique"] == 1
    assert ev["cuda_graph"] and ev["cuda_graph"].get("captured"), ev["cuda_graph"]
    for side in ("tpo", "stock"):
        tp = items["7_throughput"][side]
        assert tp["output_tokens"] == tp["requests"] * tp["new_tokens"], (side, tp)
