"""Rollout side on one GPU, items 1-7 of the rollout issue (small sample; the full sample is
``python -m true_on_policy.acceptance --out ...`` and ``python -m true_on_policy.parity``).

Chain: rollout (graphs, chunked prefill) == patched trainer -> alone == batch of 32 ==
interleaved -> radix hit == cold -> graph == eager (and chunked == unsplit) -> 100 repeats, one
output -> overlay off == no plugin -> throughput ratio reported (not asserted: a benchmark)."""

import pytest

pytestmark = pytest.mark.gpu


def test_rollout_acceptance_small(tiny_cache, gpu_evidence):
    from true_on_policy.acceptance import run

    ev = run("embedded", small=True)
    items = ev["items"]
    gpu_evidence.append({"test": "rollout_acceptance_small", "items": items, "cuda_graph": ev["cuda_graph"]})
    for t in (1.0, 0.7):
        one = items[f"1_rollout_eq_trainer_t{t}"]
        assert one["max_abs_diff"] == 0.0 and one["exact_fraction"] == 1.0, one
        assert items[f"4_graph_eq_eager_t{t}"]["bitwise"], items[f"4_graph_eq_eager_t{t}"]
        assert items[f"6_inert_t{t}"]["bitwise"], items[f"6_inert_t{t}"]
    for k in ("2_alone_eq_batch32", "2_alone_eq_interleaved", "3_radix_hit_eq_cold"):
        assert items[k]["bitwise"], (k, items[k])
    assert items["5_repeats_unique"] == 1
    assert ev["cuda_graph"] and ev["cuda_graph"].get("captured"), ev["cuda_graph"]
    assert items["7_throughput"]["ratio"] > 0
