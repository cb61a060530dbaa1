"""CPU tier: the GEMM sweep's shapes come from the geometry it is given (``--dense-geometry``,
``--moe-geometry``), and 30B-A3B's layer without one."""

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _benchmarks_importable(monkeypatch):  # for this test only: benchmarks/kernels.py would shadow HF's kernels
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))


def test_without_a_geometry_the_shapes_are_30b_a3b_layers():
    import gemm_sweep

    assert gemm_sweep.moe_shape(None) == {"experts": 128, "top_k": 8, "hidden": 2048, "inter": 768}
    assert gemm_sweep.dense_shapes(None) == {"qkv": (5120, 2048), "o": (2048, 4096), "router": (128, 2048)}


@pytest.mark.parametrize("g", ["a3b48", "h1536e256k6", "h3072e64k4", "a22b_h200", "a35b_h200"])
def test_the_moe_shape_is_the_geometry_s(g):
    import gemm_sweep
    from geometries import spec

    s = spec(g)
    assert gemm_sweep.moe_shape(g) == {"experts": s["num_experts"], "top_k": s["num_experts_per_tok"],
                                       "hidden": s["hidden_size"], "inter": s["moe_intermediate_size"]}
    assert gemm_sweep.dense_shapes(g)["router"] == (s["num_experts"], s["hidden_size"])


def test_an_unknown_geometry_is_refused():
    import gemm_sweep

    with pytest.raises(Exception, match="nope"):
        gemm_sweep.moe_shape("nope")
