"""CPU tier: the op profile's reading of its own evidence. The op rule (``step_ops.OPS``) puts the
same kind of work in the same op for stock and for the contracts, checked on the kernel names of
two committed GPU profiles, and leaves under 5 % of each of their steps in "other"; the tables are
well formed for any set of variants; ``--render`` re-reads a file without writing; ``--resume``
finishes a committed file with stock done by running only the missing variants (on a stand-in
runner), each variant keeping the provenance of the run that measured it."""

import json
import os
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]
FLAT = ROOT / "evidence" / "profile-flat-a3b48.json"  # stock and tpo_flat, before workloads were recorded
TAIL = ROOT / "evidence" / "profile-tail-h1536e256k6-before.json"  # stock only (the run hit its time limit)

# op -> kernels (substrings of real names in FLAT and TAIL): stock's and the contracts' forms of each op
SAME_WORK = {
    "MoE": ["fused_moe_kernel", "moe_align_block_size_kernel", "count_and_sort_expert_tokens_kernel",
            "moe_sum_reduce", "act_and_mul_kernel", "_router_triton_kernel",  # stock
            "_grouped_tma_kernel", "_align_kernel", "_count_kernel", "_route_kernel", "_silu_mul_kernel",
            "_combine_kernel"],  # the contracts
    "attention": ["_fwd_grouped_kernel_stage1", "_fwd_kernel_stage2", "_fwd_kernel", "create_flashinfer_kv_indices",
                  "get_num_kv_splits_triton", "_attention_kernel", "_merge_kernel"],
    "RMSNorm": ["flashinfer::norm::FusedAddRMSNormKernel", "flashinfer::norm::RMSNormKernel", "fused_qknorm_warp",
                "_rmsnorm_kernel", "_rmsnorm_tile_kernel"],
    "dense GEMM": ["nvjet_sm90", "cublasLt::splitKreduce_kernel", "_matmul_tma_kernel"],
    "RoPE": ["fused_rope_store_kernel", "_rope_kernel"],
    "KV write": ["store_kvcache"],
    "sampling / log-probs": ["cunn_SoftMaxForward", "ArgMaxOps", "_gumbel_argmax_kernel", "_shard_stats_kernel",
                             "_finish_kernel"],
    "batch metadata (positions, req_to_token)": ["compute_position_kernel", "clamp_position_kernel",
                                                 "write_req_to_token_pool_triton"],
    "torch glue (elementwise, index, sort, copy)": [
        "DeviceRadixSort", "DeviceScanKernel", "tensor_kernel_scan_innermost_dim", "_assert_async_cuda_kernel",
        "Memcpy DtoD", "direct_copy_kernel_cuda"],
}


@pytest.fixture(autouse=True)
def _benchmarks_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))


def _steps(doc):
    """(variant, step, row) of every decode row and prefill of a stored profile."""
    import step_ops

    for v in doc["variants"]:
        for w, rows in step_ops.decode_rows(v).items():
            for b, row in rows.items():
                yield v["variant"], f"{w} bs={b}", row
        if v.get("prefill"):
            yield v["variant"], "prefill", v["prefill"]


def _names(*paths):
    import step_ops

    return {step_ops.kernel_name(k["kernel"]) for p in paths for _, _, r in _steps(json.loads(p.read_text()))
            for k in r["kernels"]}


def test_the_same_work_lands_in_the_same_op_for_stock_and_the_contracts():
    import step_ops

    names = _names(FLAT, TAIL)
    for op, parts in SAME_WORK.items():
        for part in parts:
            hits = [n for n in names if part in n]
            assert hits, f"{part!r}: no such kernel in the committed profiles"
            assert {step_ops.op_of(n) for n in hits} == {op}, (part, {n[:80]: step_ops.op_of(n) for n in hits})


@pytest.mark.parametrize("path", [FLAT, TAIL], ids=["flat-a3b48", "tail-h1536e256k6"])
def test_other_is_under_5_percent_of_every_step_of_the_committed_profiles(path):
    import step_ops

    for variant, step, row in _steps(json.loads(path.read_text())):
        ops = step_ops.ops_of(row["kernels"])
        assert sum(ops.values()) == pytest.approx(row["gpu_us_per_step"])  # every kernel counted once
        assert ops.get(step_ops.OTHER, 0.0) < 0.05 * row["gpu_us_per_step"], (variant, step, ops)


def test_every_contract_kernel_has_an_op():
    import step_ops

    src = "\n".join(p.read_text() for p in sorted((ROOT / "kernels").glob("*.py")))
    kernels = re.findall(r"@triton\.jit[^\n]*\n(?:@[^\n]*\n)*def (\w+_kernel)\(", src)
    assert len(kernels) >= 15
    assert {k: step_ops.op_of(k) for k in kernels if step_ops.op_of(k) == step_ops.OTHER} == {}


@pytest.mark.parametrize("name,op", [
    ("void flashinfer::sampling::TopKTopPSamplingFromProbKernel<1024u>", "sampling / log-probs"),  # not attention
    ("void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>", "sampling / log-probs"),  # not routing
    ("void flashinfer::BatchDecodeWithPagedKVCacheKernel<128u>", "attention"),
    ("_merge_kernel grid=[64, 1, 4]", "attention"),  # the stored name carries the grid
    ("_matmul_kernel grid=[2, 8, 1]", "tree GEMM (o_proj; MoE where no other form fits)"),
    ("_seg_tree_kernel", "MoE"),
    ("void at::native::normal_kernel<float>", "other"),  # neither a norm ...
    ("void property_kernel", "other"),  # ... nor RoPE
])
def test_the_rule_order_and_anchors(name, op):
    import step_ops

    assert step_ops.op_of(name) == op


def _row(gpu=100.0):
    kernels = [{"kernel": "_grouped_tma_kernel grid=[8, 1, 1]", "op": "other", "us_per_step": 0.6 * gpu,
                "launches_per_step": 1.0},
               {"kernel": "_attention_kernel", "op": "attention", "us_per_step": 0.4 * gpu, "launches_per_step": 1.0}]
    return {"gpu_us_per_step": gpu, "ops_us": {"other": 0.6 * gpu, "attention": 0.4 * gpu}, "kernels": kernels,
            "watched_per_step": {}, "step_ms": gpu / 200, "host_ms": {"prepare": 0.1, "forward": 0.3, "sample": 0.1}}


def _variant(name, workloads=("plain", "qwen"), batches=(1, 4), gpu=100.0):
    dw = {w: {str(b): _row(gpu) for b in batches} for w in workloads}
    return {"variant": name, "decode_workloads": dw, "decode": dw[workloads[0]], "prefill": {**_row(gpu), "tokens": 64},
            "contract": None}


def _tables(md):
    """Each table of ``md`` as its rows of cells."""
    out, cur = [], None
    for line in md.splitlines():
        if line.startswith("|"):
            if cur is None:
                cur = []
                out.append(cur)
            cur.append([c.strip() for c in line.strip("|").split("|")])
        else:
            cur = None
    return out


@pytest.mark.parametrize("names", [["stock"], ["stock", "tpo"], ["stock", "stock_fi", "tpo", "tpo_v1"], ["tpo"],
                                   ["tpo", "stock"]])
def test_the_table_has_a_ratio_column_per_contract_when_stock_is_there(names):
    import engines
    import step_ops

    vs = [_variant(n, gpu=100.0 * (i + 1)) for i, n in enumerate(names)]
    if len(names) > 1:
        vs[-1]["decode_workloads"]["qwen"].pop("4")  # a variant without a row leaves that block, not the table
    doc = {"geometry": "g", "context": 512, "batches": [1, 4], "workloads": ["plain", "qwen"], "variants": vs,
           "flags": []}
    tables = _tables(step_ops.markdown(doc, engines.STOCK_EXTRA))
    assert len(tables) == 2 * 2 + 1  # the decode blocks and the prefill
    for i, t in enumerate(tables):
        want = names[:-1] if i == 3 and len(names) > 1 else names  # (qwen, batch 4)
        contracts = [n for n in want if n not in engines.STOCK_EXTRA] if "stock" in want else []
        assert t[0] == ["op", *(f"{n} µs" for n in want), *(f"{c}/stock" for c in contracts)]
        assert t[1] == ["---", *["---:"] * (len(t[0]) - 1)]
        assert all(len(r) == len(t[0]) for r in t), t
        ops = {r[0]: r[1:] for r in t[2:]}
        assert "other" not in ops and ops["MoE"][0] == f"{60 * (names.index(want[0]) + 1):.0f}"
        total = ops["total (GPU)"][len(want):]
        assert total == [f"{(names.index(c) + 1) / (names.index('stock') + 1):.2f}" for c in contracts]


def test_render_prints_the_committed_files_with_the_current_rule_and_writes_nothing(capsys):
    import op_profile

    before = {p: p.read_bytes() for p in (FLAT, TAIL)}
    assert op_profile.main(["--render", str(FLAT)]) == 0
    flat = capsys.readouterr().out
    assert op_profile.main(["--render", str(TAIL)]) == 0
    tail = capsys.readouterr().out
    assert {p: p.read_bytes() for p in (FLAT, TAIL)} == before
    assert "| op | stock µs | tpo_flat µs | tpo_flat/stock |\n|---|---:|---:|---:|\n" in flat
    assert "| op | stock µs |\n|---|---:|\n" in tail and "| other |" not in flat + tail
    assert "not recorded in this file" in flat and "no contract variant in this file" in tail


def _phase_result(variant, workloads, batches):
    return {**_variant(variant, workloads, batches), "server_args": {}}


def _resume(monkeypatch, tmp_path, gpu_name):
    """Run the tail profile's command against a copy of TAIL on a stand-in runner, as a run of
    another commit on a GPU named ``gpu_name``; the variants it ran and the file it left."""
    import geometries
    import op_profile

    from true_on_policy.harness import provenance

    old = json.loads(TAIL.read_text())
    out = tmp_path / TAIL.name
    out.write_text(TAIL.read_text())
    prov = {**old["provenance"], "git": {"commit": "f" * 40, "dirty": False, "diff_sha256": None,
                                         "source_sha256": "e" * 64}, "gpu": {"count": 1, "name": gpu_name},
            "started_at": "2026-12-03T00:00:00+00:00"}
    monkeypatch.setattr(provenance, "provenance", lambda argv=None: prov)
    monkeypatch.setattr(geometries, "ensure", lambda name, room=False: old["model_path"])
    ran = []

    def fake_run(cmd):
        v = cmd[cmd.index("--phase") + 1]
        ran.append(v)
        out_line = "RESULT " + json.dumps(_phase_result(v, old["workloads"], old["batches"]))
        return SimpleNamespace(returncode=0, stdout=f"{v} decode ...\n{out_line}\n", stderr="")

    monkeypatch.setattr(op_profile, "_run_phase", fake_run)
    op_profile.main(["--geometry", "h1536e256k6", "--batches", "1", "4", "16", "64", "--workload", "plain", "qwen",
                     "--variants", "stock", "stock_fi", "tpo", "tpo_v1", "--mem", "0.85", "--make-room", "--resume",
                     "--out", str(out)])
    return ran, json.loads(out.read_text()), old, prov


def test_resume_finishes_the_committed_tail_profile_with_each_variants_provenance(monkeypatch, tmp_path):
    ran, d, old, prov = _resume(monkeypatch, tmp_path, "NVIDIA H200")  # TAIL's GPU
    assert ran == ["stock_fi", "tpo", "tpo_v1"]  # stock kept, not run again
    assert d["complete"] and [v["variant"] for v in d["variants"]] == ["stock", "stock_fi", "tpo", "tpo_v1"]
    assert d["provenance"]["git"] == prov["git"] and d["provenance"]["started_at"] == prov["started_at"]  # the last run
    stock = d["variants"][0]
    assert stock["provenance"]["git"]["commit"] == old["provenance"]["git"]["commit"]  # its own run, kept
    assert stock["provenance"]["started_at"] == old["provenance"]["started_at"]
    assert all(v["provenance"]["git"]["commit"] == "f" * 40 for v in d["variants"][1:]) and d["sources"] == 2
    assert stock["decode_workloads"]["plain"]["1"]["gpu_us_per_step"] == (
        old["variants"][0]["decode_workloads"]["plain"]["1"]["gpu_us_per_step"])
    assert "other" not in stock["decode_workloads"]["plain"]["1"]["ops_us"]  # regrouped by the current rule
    assert "RMSNorm" in stock["decode_workloads"]["plain"]["1"]["ops_us"]
    md = d["table"]
    assert not (tmp_path / TAIL.name).with_suffix(".md").exists() and "## Runs (2 sources" in md
    assert f"| stock | {old['provenance']['git']['commit'][:12]} | False |" in md
    assert "| op | stock µs | stock_fi µs | tpo µs | tpo_v1 µs | tpo/stock | tpo_v1/stock |" in md


def test_resume_keeps_nothing_measured_on_another_gpu(monkeypatch, tmp_path):
    ran, d, _, _ = _resume(monkeypatch, tmp_path, "NVIDIA B200")
    assert ran == ["stock", "stock_fi", "tpo", "tpo_v1"] and d["sources"] == 1


@pytest.mark.parametrize("requests,heading", [(None, "## prefill, 64 tokens\n"), (1, "## prefill, 64 tokens\n"),
                                              (16, "## prefill, 64 tokens in 16 requests\n")])
def test_the_prefill_heading_names_its_requests(requests, heading):
    import engines
    import step_ops

    vs = [_variant("stock"), _variant("tpo")]
    for v in vs:
        if requests is not None:
            v["prefill"]["requests"] = requests
    md = step_ops.markdown({"geometry": "g", "context": 512, "batches": [1], "workloads": ["plain"], "variants": vs,
                            "flags": []}, engines.STOCK_EXTRA)
    assert heading in md and md.count("## prefill") == 1


@pytest.mark.parametrize("requests", [0, -1, 4097])
def test_prefill_requests_outside_one_to_the_tokens_are_refused(requests, capsys):
    import op_profile

    with pytest.raises(SystemExit):
        op_profile.main(["--prefill", "4096", "--prefill-requests", str(requests)])
    assert "--prefill-requests" in capsys.readouterr().err


class _Loaded(Exception):
    """Where the stand-in server arguments stop ``phase``: before any model loads."""


@pytest.mark.parametrize("variant,tuned", [("stock_moe", "/cache/stock-moe/ckpt"), ("stock", None)])
def test_a_tuned_stock_profiles_with_its_tuned_moe_tiles(monkeypatch, tmp_path, variant, tuned):
    """``stock_moe``'s phase points SGLang at the tiles tuned for the checkpoint before its server
    arguments exist (SGLang reads them when it loads); plain ``stock`` gets no such folder."""
    import engines
    import op_profile

    monkeypatch.setenv("SGLANG_MOE_CONFIG_DIR", "")  # recorded, so that teardown removes what phase sets
    monkeypatch.delenv("SGLANG_MOE_CONFIG_DIR")
    calls = []

    def fake_tuning(name, model_path):
        calls.append((name, model_path))
        if name not in engines.MOE_TUNED:
            return {}, None
        return {"SGLANG_MOE_CONFIG_DIR": "/cache/stock-moe/ckpt"}, {"file_name": "E=128,N=1536,device_name=X.json"}

    seen = {}

    def fake_server_args(v, model_path, max_bs, mem, manifest_dir):
        seen["dir"] = os.environ.get("SGLANG_MOE_CONFIG_DIR")
        raise _Loaded

    monkeypatch.setattr(op_profile, "moe_tuning", fake_tuning)
    monkeypatch.setattr(op_profile, "_server_args", fake_server_args)
    pytest.importorskip("sglang.benchmark.one_batch")
    with pytest.raises(_Loaded):
        op_profile.phase(variant, "/ckpt", SimpleNamespace(batches=[1, 4], mem=0.85), str(tmp_path))
    assert calls == [(variant, "/ckpt")] and seen["dir"] == tuned
    assert "stock_moe" in op_profile.VARIANTS and "stock_fi_moe" in op_profile.VARIANTS
