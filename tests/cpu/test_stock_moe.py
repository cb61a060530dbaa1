"""CPU tier: the tuned stock (``benchmarks/stock_moe.py``, the ``stock_moe`` variants). The candidate
tiles come from the files SGLang ships, the fastest is kept per batch, the folder written is the one
SGLang's own lookup reads (for the tuned shape, and for every shape it ships), and the variants'
servers get that folder and nothing else differs from ``stock``. The timing itself is the GPU's."""

import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import engines  # noqa: E402
import geometries  # noqa: E402
import stock_moe  # noqa: E402

H200 = "NVIDIA_H200"


def test_shipped_files_are_this_gpus_bf16_tiles_and_the_nearest_shapes_come_first():
    files = stock_moe.shipped(stock_moe.package_root(), H200)
    assert (128, 768) in files and (128, 1536) not in files  # 30B-A3B's shape ships, 235B-A22B's at TP 1 does not
    assert all(f.name.endswith(f"device_name={H200}.json") for f in files.values())  # no fp8, no "_down"
    assert files[(128, 768)].parent.name == "triton_3_6_0"  # the newest Triton's where several have one
    near = stock_moe.nearest(files, 128, 1536)
    assert len(near) == stock_moe.NEAREST == len(set(near))
    dist = [abs(math.log2(int(f.name.split(",")[0][2:]) / 128)) + abs(math.log2(int(f.name.split(",")[1][2:]) / 1536))
            for f in stock_moe.nearest(files, 128, 1536, k=len(files))]
    assert dist == sorted(dist)
    assert stock_moe.shipped(stock_moe.package_root(), "NO_SUCH_GPU") == {}


def test_candidates_are_the_default_then_each_tables_tile_at_the_nearest_batch():
    default = {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 32, "GROUP_SIZE_M": 8}
    a = {"1": {"BLOCK_SIZE_M": 16}, "64": {"BLOCK_SIZE_M": 32}, "4096": {"BLOCK_SIZE_M": 128}}
    b = {"2": {"BLOCK_SIZE_M": 16}, "1024": dict(default)}
    assert stock_moe.at(a, 40) == {"BLOCK_SIZE_M": 32} and stock_moe.at(a, 3000) == {"BLOCK_SIZE_M": 128}
    assert stock_moe.candidates(1, default, [a, b]) == [default, {"BLOCK_SIZE_M": 16}]  # b's tile at 2 repeats a's
    assert stock_moe.candidates(3000, default, [a, b]) == [default, {"BLOCK_SIZE_M": 128}]  # b's is the default


def test_tune_keeps_the_fastest_tile_per_batch_and_every_time():
    default = {"BLOCK_SIZE_M": 64}
    tables = [{"1": {"BLOCK_SIZE_M": 16}, "512": {"BLOCK_SIZE_M": 128}}]
    ms = {(1, 64): 2.0, (1, 16): 1.0, (512, 64): 3.0, (512, 128): math.inf}  # 128 rows cannot run at 512

    out = stock_moe.tune([1, 512], lambda m: default, tables, lambda m, c: ms[m, c["BLOCK_SIZE_M"]])
    assert out["configs"] == {"1": {"BLOCK_SIZE_M": 16}, "512": {"BLOCK_SIZE_M": 64}}
    r1, r512 = out["rows"]
    assert (r1["default_ms"], r1["best_ms"], r1["best_is_default"]) == (2.0, 1.0, False)
    assert r512["best_is_default"] and [c["ms"] for c in r512["candidates"]] == [3.0, None]
    with pytest.raises(RuntimeError, match="no candidate tile ran at batch 1"):
        stock_moe.tune([1], lambda m: default, tables, lambda m, c: math.inf)


def _lookup(monkeypatch, folder, e, n):
    """SGLang's own lookup of the tiles for (e, n) on an H200, with SGLANG_MOE_CONFIG_DIR at ``folder``."""
    from types import SimpleNamespace

    from sglang.srt.layers.moe.moe_runner.triton_utils import fused_moe_triton_config as c

    monkeypatch.setattr(c, "get_device_name", lambda *a: "NVIDIA H200")
    monkeypatch.setattr(c, "get_exec", lambda: SimpleNamespace(deterministic=SimpleNamespace(
        enable_deterministic_inference=False)))
    monkeypatch.setenv("SGLANG_MOE_CONFIG_DIR", str(folder))
    c.get_moe_configs.cache_clear()  # SGLang caches it per shape: a server reads its folder once
    try:
        return c.get_moe_configs(e, n, None), c.get_config_file_name(e, n, None)
    finally:
        c.get_moe_configs.cache_clear()


def test_the_folder_written_is_what_sglang_reads_for_the_tuned_shape_and_every_shipped_one(monkeypatch, tmp_path):
    import triton

    root = stock_moe.package_root()
    tuned = {"1": {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 1, "num_warps": 4,
                   "num_stages": 4}, "4096": {"BLOCK_SIZE_M": 128, "BLOCK_SIZE_N": 256, "BLOCK_SIZE_K": 64,
                                              "GROUP_SIZE_M": 16, "num_warps": 8, "num_stages": 3}}
    name = "E=128,N=1536,device_name=NVIDIA_H200.json"
    assert _lookup(monkeypatch, root, 128, 1536)[0] is None  # SGLang's own folder: none, its fixed default
    stock_moe.write_dir(tmp_path / "moe", root, name, tuned, triton.__version__)
    got, file_name = _lookup(monkeypatch, tmp_path / "moe", 128, 1536)
    assert file_name == name and got == {int(k): v for k, v in tuned.items()}
    linked, _ = _lookup(monkeypatch, tmp_path / "moe", 128, 768)  # 30B-A3B's file, through the links
    assert linked and linked == _lookup(monkeypatch, root, 128, 768)[0]  # as from SGLang's own folder
    stock_moe.write_dir(tmp_path / "moe", root, name, {"1": tuned["1"]}, triton.__version__)  # rewritten in place
    assert _lookup(monkeypatch, tmp_path / "moe", 128, 1536)[0] == {1: tuned["1"]}


def test_shape_of_is_the_per_rank_shape_sglang_names_its_file_by():
    spec = geometries.SPACE["a22b_h200"]
    assert stock_moe.shape_of(spec) == {"experts": 128, "n": 1536, "hidden": 4096, "top_k": 8}
    assert stock_moe.shape_of(spec, tp=2)["n"] == 768
    with pytest.raises(ValueError, match="does not divide by TP 5"):
        stock_moe.shape_of(spec, tp=5)


def test_shape_of_reads_the_config_json_a_saved_checkpoint_has(tmp_path):
    """transformers writes a Qwen3MoeConfig's expert count as ``num_local_experts``; the tuner reads that file."""
    from true_on_policy import tiny_model
    spec = geometries.SPACE["h1536e256k6"]
    tiny_model.hf_config(spec).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert "num_experts" not in config
    assert stock_moe.shape_of(config) == stock_moe.shape_of(spec) == {
        "experts": spec["num_experts"], "n": spec["moe_intermediate_size"], "hidden": spec["hidden_size"],
        "top_k": spec["num_experts_per_tok"]}


def test_the_tuned_stocks_differ_from_stock_only_in_the_tile_folder_their_servers_read(monkeypatch, tmp_path):
    assert engines.stock_args("stock_moe") == engines.stock_args("stock")
    assert engines.stock_args("stock_fi_moe") == engines.stock_args("stock_fi")
    assert set(engines.MOE_TUNED) <= set(engines.FAIR_STOCK)
    assert engines.runs("stock_fi_moe", "qwen") and not engines.runs("stock_fi_moe", "plain")
    assert engines.moe_tuning("stock", "/m") == ({}, None)

    calls = []

    def fake_run(cmd, **kw):
        calls.append(cmd)
        dest = Path(cmd[cmd.index("--dir") + 1])
        dest.mkdir(parents=True, exist_ok=True)
        (dest / "tuned.json").write_text(json.dumps({
            "file_name": "E=1,N=2,device_name=X.json", "device_name": "X", "triton": "3.6.0", "shape": {},
            "shipped_for_this_shape": False, "candidate_files": [], "seconds": 1.0, "configs": {"1": {}},
            "rows": [{"batch": 1, "default_ms": 2.0, "best_ms": 1.0, "best_is_default": False, "best": {},
                      "candidates": []}]}))
        return type("Done", (), {"returncode": 0, "stdout": "", "stderr": ""})()

    monkeypatch.setattr(engines.subprocess, "run", fake_run)
    monkeypatch.setenv("TRUE_ON_POLICY_CACHE", str(tmp_path))
    env, rec = engines.moe_tuning("stock_fi_moe", "/ckpt/qwen3-moe-a22b/")
    assert env == {"SGLANG_MOE_CONFIG_DIR": str(tmp_path / "stock-moe" / "qwen3-moe-a22b")}
    assert calls[0][1].endswith("benchmarks/stock_moe.py") and calls[0][2:4] == ["--model-path", "/ckpt/qwen3-moe-a22b/"]
    assert rec["rows"] == [{"batch": 1, "default_ms": 2.0, "best_ms": 1.0, "best_is_default": False}]

    monkeypatch.setattr(engines.subprocess, "run", lambda cmd, **kw: type(
        "Done", (), {"returncode": 1, "stdout": "", "stderr": "no candidate tile ran at batch 1"})())
    with pytest.raises(RuntimeError, match="stock_moe: tuning SGLang's MoE tiles failed .*no candidate tile ran"):
        engines.moe_tuning("stock_moe", "/ckpt/other")

    seen = []
    monkeypatch.setattr(engines.subprocess, "Popen", lambda cmd, **kw: seen.append((cmd, kw["env"])))
    monkeypatch.setattr(engines.HttpEngine, "_wait_up", lambda self, t: None)
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    engines.HttpEngine("stock", "/m", 0.5, port=1)
    engines.HttpEngine("stock_moe", "/m", 0.5, port=1, env_vars=env)
    (stock_cmd, stock_env), (moe_cmd, moe_env) = seen
    assert stock_cmd == moe_cmd and "SGLANG_MOE_CONFIG_DIR" not in stock_env
    assert moe_env["SGLANG_MOE_CONFIG_DIR"] == env["SGLANG_MOE_CONFIG_DIR"]


def test_run_tuning_names_sglangs_file_and_says_why_no_tile_ran(monkeypatch):
    from types import SimpleNamespace

    import sglang.srt.utils as sglang_utils
    from sglang.srt.layers.moe.moe_runner.triton_utils import fused_moe_triton_config as c

    for mod in (sglang_utils, c):
        monkeypatch.setattr(mod, "get_device_name", lambda *a: "NVIDIA H200")
    monkeypatch.setattr(c, "get_exec", lambda: SimpleNamespace(deterministic=SimpleNamespace(
        enable_deterministic_inference=False)))  # what gpu_timer's publish gives SGLang's default tile
    shape = stock_moe.shape_of(geometries.SPACE["a22b_h200"])

    def timer_of(ms):
        def timer(m, cfg):
            if ms is None:
                timer.errors.append(f"batch {m}: AssertionError: tensor model parallel group is not initialized")
                return math.inf
            return ms(cfg)

        timer.errors = []
        return timer

    monkeypatch.setattr(stock_moe, "gpu_timer", lambda shape, path=None: timer_of(lambda cfg: 1.0 / cfg["BLOCK_SIZE_N"]))
    rec = stock_moe.run_tuning(shape, [1, 4096])
    assert rec["file_name"] == "E=128,N=1536,device_name=NVIDIA_H200.json" and not rec["shipped_for_this_shape"]
    assert len(rec["candidate_files"]) == stock_moe.NEAREST and set(rec["configs"]) == {"1", "4096"}
    for r in rec["rows"]:  # the widest N tile is "fastest" here
        assert r["best"]["BLOCK_SIZE_N"] == max(c["config"]["BLOCK_SIZE_N"] for c in r["candidates"])

    monkeypatch.setattr(stock_moe, "gpu_timer", lambda shape, path=None: timer_of(None))
    with pytest.raises(RuntimeError, match="no candidate tile ran at batch 1.*tensor model parallel group"):
        stock_moe.run_tuning(shape, [1])


def test_a_checkpoint_is_tuned_once_into_the_folder_its_server_reads(monkeypatch, tmp_path, capsys):
    import triton

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(geometries.SPACE["a22b_h200"]))
    tuned = []

    def fake(shape, batches=stock_moe.BATCHES, model_path=None):
        tuned.append((shape, model_path))
        return {"file_name": "E=128,N=1536,device_name=NVIDIA_H200.json", "triton": triton.__version__,
                "device_name": stock_moe.device_name(),
                "configs": {"1": {"BLOCK_SIZE_M": 16}}, "rows": [], "seconds": 1.0}

    monkeypatch.setattr(stock_moe, "run_tuning", fake)
    gpu = ["NVIDIA_H200"]
    monkeypatch.setattr(stock_moe, "device_name", lambda: gpu[0])
    dest = tmp_path / "moe"
    for reused, card in ((False, "NVIDIA_H200"), (True, "NVIDIA_H200"), (False, "NVIDIA_H100_80GB_HBM3")):
        gpu[0] = card
        assert stock_moe.main(["--model-path", str(ckpt), "--dir", str(dest)]) == 0
        out = json.loads(capsys.readouterr().out.split("RESULT ", 1)[1])
        assert out["reused"] is reused and out["dir"] == str(dest)
    shape = stock_moe.shape_of(geometries.SPACE["a22b_h200"])
    assert tuned == [(shape, str(ckpt))] * 2  # once per card
    written = dest / "configs" / ("triton_" + triton.__version__.replace(".", "_")) / out["file_name"]
    assert json.loads(written.read_text()) == {"1": {"BLOCK_SIZE_M": 16}}
    assert json.loads((dest / "tuned.json").read_text())["file_name"] == out["file_name"]
