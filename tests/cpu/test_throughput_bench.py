"""CPU tier: the throughput benchmark without a GPU. The workload draws, the geometries' sizes and
layer counts, the variant process's protocol (on a stand-in engine), the run's rounds, resume and
time budget (on stand-in variant processes), the medians and ratios, and the evidence's shape. The
GPU runs are ``regenerate_evidence.sh space`` and ``tailprofile``."""

import io
import json
import statistics
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import engines  # noqa: E402
import geometries  # noqa: E402
import results  # noqa: E402
import throughput  # noqa: E402
import workloads as wl  # noqa: E402

# ---------------------------------------------------------------- workloads


def test_tail_draw_is_seeded_85_15_and_in_range():
    lens = wl.tail_lengths(256)
    assert lens == wl.tail_lengths(256)  # the same draw in every pass, variant and run
    assert lens != wl.tail_lengths(256, seed=wl.TAIL_SEED + 1)
    long = [n for n in lens if n >= wl.TAIL_LONG[0]]
    short = [n for n in lens if n <= wl.TAIL_SHORT[1]]
    assert len(long) == round(0.15 * 256) == 38 and len(short) == 256 - 38  # every length is one or the other
    assert all(1024 <= n <= 2048 for n in long) and all(32 <= n <= 256 for n in short)
    assert len(set(long)) > 20 and len(set(short)) > 100  # drawn, not constant
    first = [i for i, n in enumerate(lens) if n >= 1024]
    assert first != list(range(38)) and first != list(range(256 - 38, 256))  # long ones spread, not a block
    for n in (1, 7, 20, 1000):
        assert sum(x >= 1024 for x in wl.tail_lengths(n)) == round(0.15 * n)


def test_workload_draws(monkeypatch):
    vocab = 300
    plain, qwen, tail, long = (wl.draw(w, vocab, 16, 8, 24, 5) for w in ("plain", "qwen", "tail", "long"))
    assert plain.prompts == qwen.prompts == tail.prompts  # one prompt set, three length/sampling rules
    assert plain.prompts == wl.draw("plain", vocab, 16, 8, 24, 5).prompts
    assert all(8 <= len(p) <= 24 and all(0 <= t < vocab for t in p) for p in plain.prompts)
    assert plain.new_tokens == [5] * 16 and tail.new_tokens == wl.tail_lengths(16)
    assert len(long.prompts) == 64 and all(1024 <= len(p) <= 2048 for p in long.prompts)
    assert long.new_tokens == [4096] * 64
    p, q = plain.params(7000), qwen.params(7000)
    assert [x["sampling_seed"] for x in p] == list(range(7000, 7016))
    assert all(x["ignore_eos"] and x["temperature"] == 1.0 and "top_k" not in x for x in p)
    assert all(x["top_k"] == 20 and x["top_p"] == 0.95 for x in q)
    assert [x["max_new_tokens"] for x in long.params(0, cap=wl.WARM_CAP)] == [256] * 64
    assert tail.expected_tokens(cap=100) == sum(min(n, 100) for n in tail.new_tokens) < tail.expected_tokens()
    rec = tail.record()
    assert rec["new_tokens"] == tail.new_tokens and rec["new_tokens_total"] == sum(tail.new_tokens)
    assert "new_tokens" not in plain.record() and qwen.record()["sampling"] == {"temperature": 1.0, "top_k": 20,
                                                                               "top_p": 0.95}
    assert [wl.get(w).passes for w in ("plain", "qwen", "tail", "long")] == [3, 3, 2, 2]
    with pytest.raises(KeyError, match="known: plain, qwen, tail, long"):
        wl.get("mixed")


# ---------------------------------------------------------------- geometries


@pytest.mark.parametrize("base,layers,total_b,active_b", [
    ("A3B", 48, 30.5, 3.3), ("A22B2", 94, 235.0, 22.0), ("A35B2", 62, 480.0, 35.0)])
def test_parameter_counts_match_the_published_models(base, layers, total_b, active_b):
    """Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder-480B-A35B at their full depth: the counts the
    model cards give (total and activated), to 2 %."""
    s = getattr(geometries.tiny_model, base)
    assert abs(geometries.params(s, layers) / 1e9 - total_b) / total_b < 0.02
    assert abs(geometries.active_params(s, layers) / 1e9 - active_b) / active_b < 0.02


@pytest.mark.parametrize("name", ["embedded", "wide"])
def test_parameter_count_is_transformers_own(name):
    """The formula counts what transformers builds (on the meta device: no memory)."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    s = dict(geometries.spec(name))
    s.pop("seed")
    with torch.device("meta"):
        m = Qwen3MoeForCausalLM(Qwen3MoeConfig(**s, tie_word_embeddings=False, decoder_sparse_step=1,
                                               mlp_only_layers=[]))
    assert sum(p.numel() for p in m.parameters()) == geometries.params(s)


def _hbm_and_ram(s, layers, b):
    w = 2 * geometries.params(s, layers)
    kv = geometries.kv_bytes_per_token(s, layers) * b.kv_tokens
    return w + kv <= b.mem_fraction * b.hbm_gib * 2**30 and w <= (b.ram_gib - b.ram_reserve_gib) * 2**30


@pytest.mark.parametrize("base", ["A22B2", "A35B2", "A3B"])
def test_fit_layers_is_the_most_that_fit(base):
    s, b = getattr(geometries.tiny_model, base), geometries.H200
    n = geometries.fit_layers(s)
    assert _hbm_and_ram(s, n, b) and not _hbm_and_ram(s, n + 1, b)
    assert geometries.fit_layers(s, geometries.Budget(ram_gib=64.0)) < n  # a smaller /dev/shm: fewer layers
    h = geometries.fit_layers(s, geometries.H100)  # an 80 GB card: the most that fit it, fewer than an H200's
    assert _hbm_and_ram(s, h, geometries.H100) and not _hbm_and_ram(s, h + 1, geometries.H100) and h < n
    with pytest.raises(ValueError, match="not one layer"):
        geometries.fit_layers(s, geometries.Budget(hbm_gib=1.0))


def test_the_space_geometries():
    t, sp = geometries.tiny_model, geometries.SPACE
    assert sp["a3b48"] == t.A3B48
    assert sp["a22b_h200"]["num_hidden_layers"] == geometries.fit_layers(t.A22B2) == 21
    assert sp["a35b_h200"]["num_hidden_layers"] == geometries.fit_layers(t.A35B2) == 6
    assert sp["a22b_h100"]["num_hidden_layers"] == geometries.fit_layers(t.A22B2, geometries.H100) == 11
    assert sp["a35b_h100"]["num_hidden_layers"] == geometries.fit_layers(t.A35B2, geometries.H100) == 3
    shape = ("hidden_size", "num_experts", "num_experts_per_tok", "moe_intermediate_size")
    # the published layer shape at either depth: only the layer count (and seed) changed
    for name in ("a22b_h200", "a35b_h200", "a22b_h100", "a35b_h100"):
        base = t.A22B2 if name.startswith("a22b") else t.A35B2
        assert {k: v for k, v in sp[name].items() if base[k] != v}.keys() <= {"num_hidden_layers", "seed"}
    theirs = [t.A3B, t.A22B2, t.A35B2]
    for name in ("h3072e64k4", "h1536e256k6"):  # ours: unlike all three in every listed attribute
        for k in (*shape, "num_attention_heads", "num_key_value_heads"):
            assert all(sp[name][k] != o[k] for o in theirs), (name, k)
        assert sp[name]["num_attention_heads"] % sp[name]["num_key_value_heads"] == 0
        assert geometries.checkpoint_bytes(sp[name]) < 40 * 2**30
    assert len({json.dumps(s, sort_keys=True) for s in sp.values()}) == len(sp)
    assert len({s["seed"] for s in sp.values()}) == len(sp)
    with pytest.raises(KeyError, match="known: a3b48, a22b_h200"):
        geometries.spec("a22b94")


def test_sglang_ships_tuned_moe_tiles_for_30b_a3b_alone_among_the_space_geometries():
    """What docs/throughput.md and the rendered issue table say of stock's MoE: SGLang names a fused-MoE
    tile file E=<experts>,N=<intermediate per rank>,device_name=<GPU>; on an H100 or an H200 it ships one
    (any Triton) for 30B-A3B's shape at TP 1 and for no other geometry of the space."""
    import stock_moe

    root = stock_moe.package_root()
    for device in ("NVIDIA_H200", "NVIDIA_H100_80GB_HBM3"):
        files = stock_moe.shipped(root, device)
        tuned = {g for g, s in geometries.SPACE.items() if (s["num_experts"], s["moe_intermediate_size"]) in files}
        assert tuned == {"a3b48"}, device


def test_ensure_needs_room_and_makes_it_only_from_other_benchmark_checkpoints(monkeypatch, tmp_path):
    monkeypatch.setenv(geometries.tiny_model.env.CACHE_DIR.name, str(tmp_path))
    other = geometries.folder("h1536e256k6")
    stranger = tmp_path / "qwen3-moe-embedded-abc"
    for d in (other, stranger):
        d.mkdir(parents=True)
        (d / "config.json").write_text("{}")
    free = {"bytes": 10 * 2**30}
    monkeypatch.setattr(geometries, "_free_bytes", lambda p: free["bytes"] + (0 if other.exists() else 40 * 2**30))
    with pytest.raises(RuntimeError, match=r"h3072e64k4: a 30\.9 GiB checkpoint does not fit .* \(10\.0 GiB free\)"):
        geometries.ensure("h3072e64k4")
    assert other.exists()
    built = []
    monkeypatch.setattr(geometries.tiny_model, "build", lambda folder, spec: (
        built.append(spec), (folder / "config.json").write_text("{}"), (folder / "model.safetensors").write_bytes(b"")))
    path = geometries.ensure("h3072e64k4", room=True)
    assert not other.exists() and stranger.exists()  # only the other benchmark geometry's checkpoint went
    assert built == [geometries.SPACE["h3072e64k4"]] and Path(path) == geometries.folder("h3072e64k4")
    assert json.loads((Path(path) / "true_on_policy_geometry.json").read_text())["hidden_size"] == 3072
    assert geometries.ensure("h3072e64k4") == path and len(built) == 1  # built once


# ---------------------------------------------------------------- the variant process


class _Eng:
    def __init__(self, flush_ok=(True,), short=0):
        self.shut, self.calls, self.flush_ok, self.short = False, [], list(flush_ok), short
        self.params = []

    def flush_cache(self):
        self.calls.append("flush")
        return type("FlushCacheReqOutput", (), {"success": self.flush_ok.pop(0) if self.flush_ok else True})()

    def get_server_info(self):
        return {"max_total_num_tokens": 123456, "cuda_graph_max_bs": 256, "unrelated": "x"}

    def generate(self, input_ids, sampling_params, return_logprob):
        self.calls.append("generate")
        self.params.append(sampling_params)
        return [{"meta_info": {"completion_tokens": p["max_new_tokens"] - self.short}} for p in sampling_params]

    def start_profile(self, **req):
        self.calls.append(("profile", req["output_dir"], req["num_steps"]))

    def shutdown(self):
        self.shut = True


def _serve(monkeypatch, tmp_path, capsys, name, commands, names=("plain",), eng=None, **kw):
    """``serve`` on a stand-in engine, fed ``commands``; returns the engine and its RESULT lines."""
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 300}))
    eng = eng or _Eng()
    monkeypatch.setattr(throughput, "start_engine", lambda name, path, mem, env_vars=None: eng)
    monkeypatch.setattr(sys, "stdin", io.StringIO(commands))
    throughput.serve(name, str(tmp_path), list(names), 4, 8, 16, 5, 0.5, **kw)
    lines = [json.loads(x[len("RESULT "):]) for x in capsys.readouterr().out.splitlines() if x.startswith("RESULT ")]
    return eng, lines


def test_variant_process_runs_each_workload_it_is_asked(monkeypatch, tmp_path, capsys):
    eng, lines = _serve(monkeypatch, tmp_path, capsys, "tpo", "warm tail\npass tail 0\npass qwen 1\nquit\n",
                        names=("tail", "qwen"))
    assert lines[0]["ready"] == "tpo" and set(lines[0]["engine"]) == set(engines.ENGINE_KEYS)
    tail = wl.tail_lengths(4)
    assert [x["cmd"] for x in lines[1:]] == [["warm", "tail"], ["pass", "tail", "0"], ["pass", "qwen", "1"]]
    assert [x["tokens"] for x in lines[1:]] == [sum(min(n, wl.WARM_CAP) for n in tail), sum(tail), 20]
    assert [p["max_new_tokens"] for p in eng.params[1]] == tail and eng.params[2][0]["top_k"] == 20
    assert eng.params[1][0]["sampling_seed"] == 7000 and eng.params[2][0]["sampling_seed"] == 8000
    assert eng.shut and eng.calls == ["flush", "generate"] * 3  # cold: every pass computes its prompts


def test_a_tuned_stock_serves_with_its_tile_folder_and_records_what_it_chose(monkeypatch, tmp_path, capsys):
    got = {}
    monkeypatch.setattr(throughput, "moe_tuning", lambda name, path: (
        {"SGLANG_MOE_CONFIG_DIR": f"/cache/{name}"}, {"file_name": "E=1.json"}) if name in engines.MOE_TUNED else ({}, None))
    eng = _Eng()

    def start(name, path, mem, env_vars=None):
        got[name] = env_vars
        return eng

    monkeypatch.setattr(throughput, "start_engine", start)
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 300}))
    for name in ("stock_moe", "stock"):
        monkeypatch.setattr(sys, "stdin", io.StringIO("quit\n"))
        throughput.serve(name, str(tmp_path), ["plain"], 4, 8, 16, 5, 0.5)
    moe, stock = [json.loads(x[len("RESULT "):]) for x in capsys.readouterr().out.splitlines() if x.startswith("RESULT ")]
    assert got == {"stock_moe": {"SGLANG_MOE_CONFIG_DIR": "/cache/stock_moe"}, "stock": {}}
    assert moe["engine"]["moe_tuned"] == {"file_name": "E=1.json"} and "moe_tuned" not in stock["engine"]


def test_a_pass_that_generates_other_lengths_than_drawn_is_an_error(monkeypatch, tmp_path, capsys):
    with pytest.raises(RuntimeError, match="completion tokens"):
        _serve(monkeypatch, tmp_path, capsys, "stock", "pass plain 0\nquit\n", eng=_Eng(short=1))
    eng, lines = _serve(monkeypatch, tmp_path, capsys, "stock", "warm plain\npass plain 0\nquit\n", cold=False)
    assert eng.calls == ["generate", "generate"]  # warm prefix cache: never flushed


def test_an_engine_that_does_not_start_is_reported(monkeypatch, tmp_path, capsys):
    def boom(name, path, mem, env_vars=None):
        raise RuntimeError("flashinfer is not installed")

    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 300}))
    monkeypatch.setattr(throughput, "start_engine", boom)
    throughput.serve("stock_fi", str(tmp_path), ["qwen"], 4, 8, 16, 5, 0.5)
    assert json.loads(capsys.readouterr().out.split("RESULT ", 1)[1]) == {
        "error": "RuntimeError: flashinfer is not installed"}


def test_flush_is_retried_then_raises(monkeypatch):
    monkeypatch.setattr(engines.time, "sleep", lambda s: None)
    busy = _Eng(flush_ok=(False, False, True))  # SGLang refuses while a request is in flight
    engines.flush(busy)
    assert busy.calls == ["flush"] * 3
    with pytest.raises(RuntimeError, match="flush_cache did not succeed"):
        engines.flush(_Eng(flush_ok=(False,) * 5), tries=5)


def test_trace_command_profiles_one_untimed_pass(monkeypatch, tmp_path, capsys):
    eng, lines = _serve(monkeypatch, tmp_path, capsys, "tpo", "pass plain 0\ntrace plain /t/tpo 40\nquit\n")
    assert eng.calls == ["flush", "generate", ("profile", "/t/tpo", 40), "flush", "generate"]
    assert lines[-1]["cmd"] == ["trace", "plain", "/t/tpo", "40"]


# ---------------------------------------------------------------- variants and engines


def test_stock_variants_differ_only_in_their_named_argument(monkeypatch):
    import sglang

    from true_on_policy import env

    seen = {}
    monkeypatch.setattr(sglang, "Engine", lambda **kw: kw)
    monkeypatch.setattr(env, "disable_overlay", lambda: None)
    for name in engines.STOCK_EXTRA:
        seen[name] = engines.start_engine(name, "/m", 0.5)
    base = seen["stock"]
    assert base["attention_backend"] == "triton" and base["sampling_backend"] == "pytorch"

    def diff(name):
        return {k: seen[name].get(k) for k in set(base) | set(seen[name]) if base.get(k) != seen[name].get(k)}

    assert diff("deterministic") == {"enable_deterministic_inference": True}
    assert diff("stock_eager_prefill") == {"cuda_graph_backend_prefill": "disabled"}
    assert diff("stock_fi") == {"sampling_backend": "flashinfer"}
    assert diff("stock_flashinfer") == {"attention_backend": "flashinfer", "sampling_backend": "flashinfer"}
    assert "stock_flashinfer" in throughput.OPTIONAL and engines.runs("stock_flashinfer", "plain")
    assert diff("stock_auto") == {"attention_backend": None, "sampling_backend": None}  # SGLang's own choice
    assert set(engines.FAIR_STOCK) == set(engines.STOCK_EXTRA) - {"deterministic"}
    assert engines.runs("stock_fi", "qwen") and not engines.runs("stock_fi", "tail") and engines.runs("tpo", "long")


def test_http_engine_runs_the_servers_users_run_and_sends_one_request_per_prompt(monkeypatch, tmp_path):
    """--http: tpo variants start ``launch.server --true-on-policy`` (with their contract), stock
    ones ``sglang.launch_server`` with the Engine's flags and no overlay in their environment; a
    pass posts every prompt as its own /generate request; the cache is emptied through
    /flush_cache (a refusal reads as not flushed); each server's log is kept in the temporary
    folder. A local stand-in answers."""
    import tempfile
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    seen, flush_status = [], [400, 200]

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _send(self, code, body):
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._send(200, {"max_total_num_tokens": 99} if self.path == "/server_info" else {})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            if self.path == "/flush_cache":
                return self._send(flush_status.pop(0), {})
            seen.append(body)
            self._send(200, {"meta_info": {"completion_tokens": body["sampling_params"]["max_new_tokens"]}})

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    cmds = []

    class _Proc:
        pid, returncode = 12345, None

        def poll(self):
            return None

        def wait(self, timeout=None):
            return 0

    monkeypatch.setattr(engines.subprocess, "Popen", lambda cmd, **kw: cmds.append((cmd, kw["env"])) or _Proc())
    monkeypatch.setattr(engines.os, "killpg", lambda pid, sig: None)
    from true_on_policy import env

    monkeypatch.setenv(env.ENABLED.name, "1")  # the caller's shell has the overlay on
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the servers' logs land here, not in /tmp
    try:
        port = srv.server_address[1]
        for name in ("tpo_flat", "deterministic", "stock_fi"):
            eng = engines.HttpEngine(name, "/m", 0.5, port=port)
            if name == "tpo_flat":
                outs = eng.generate([[1, 2], [3], [4, 5, 6]], [{"max_new_tokens": n} for n in (2, 3, 4)], True)
                assert [o["meta_info"]["completion_tokens"] for o in outs] == [2, 3, 4]
                assert sorted(len(b["input_ids"]) for b in seen) == [1, 2, 3] and all(b["return_logprob"] for b in seen)
                assert [eng.flush_cache().success, eng.flush_cache().success] == [False, True]
                assert eng.get_server_info()["max_total_num_tokens"] == 99
            eng.shutdown()
    finally:
        srv.shutdown()
    (tpo_cmd, _), (det_cmd, det_env), (fi_cmd, _) = cmds
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"tpo-throughput-{n}-{port}.log"
                                                          for n in ("deterministic", "stock_fi", "tpo_flat")]
    assert tpo_cmd[1:5] == ["-m", "launch.server", "--true-on-policy", "--true-on-policy-contract"]
    assert tpo_cmd[5] == engines.FLAT and tpo_cmd[tpo_cmd.index("--port") + 1] == str(port)
    assert det_cmd[1:3] == ["-m", "sglang.launch_server"] and "--enable-deterministic-inference" in det_cmd
    assert det_cmd[det_cmd.index("--attention-backend") + 1] == "triton" and env.ENABLED.name not in det_env
    assert fi_cmd.count("--sampling-backend") == 1 and fi_cmd[fi_cmd.index("--sampling-backend") + 1] == "flashinfer"
    assert engines.cli_flags({"cuda_graph_backend_prefill": "disabled", "x_y": True}) == [
        "--cuda-graph-backend-prefill", "disabled", "--x-y"]


def test_each_tpo_variant_runs_the_contract_it_is_recorded_under(monkeypatch, tmp_path):
    import tempfile

    from true_on_policy import DEFAULT_CONTRACT
    from true_on_policy.rollout import engine as eng_mod

    monkeypatch.setattr(eng_mod, "TrueOnPolicyEngine", lambda **kw: kw)
    for key in {k for env in engines.TPO_ENV.values() for k in env}:  # start_engine sets a variant's environment:
        monkeypatch.setenv(key, "")  # undone after the test, so no later test inherits it
    popen = []
    monkeypatch.setattr(engines.subprocess, "Popen", lambda cmd, **kw: popen.append(cmd) or None)
    monkeypatch.setattr(engines.HttpEngine, "_wait_up", lambda self, t: None)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the servers' logs land here, not in /tmp
    for name in (v for v in throughput.VARIANTS if v not in engines.STOCK_EXTRA):
        want = engines.variant_contract(name)["name"]
        assert want == engines.CONTRACTS.get(name, DEFAULT_CONTRACT)
        assert engines.start_engine(name, "/m", 0.5).get("contract", DEFAULT_CONTRACT) == want
        engines.HttpEngine(name, "/m", 0.5, port=1)
        cmd = popen[-1]
        got = cmd[cmd.index("--true-on-policy-contract") + 1] if "--true-on-policy-contract" in cmd else DEFAULT_CONTRACT
        assert got == want, (name, cmd)
    assert {"tpo_pg", "tpo_flat_pg", "stock_fi"}.isdisjoint(throughput.DEFAULT_VARIANTS)
    assert engines.variant_contract("stock_fi") is None


# ---------------------------------------------------------------- medians and ratios


def _p(*tps):
    return [{"tokens_per_s": x, "tokens": 100, "seconds": 100 / x, "start": 0} for x in tps]


def test_each_workload_is_judged_against_its_fastest_stock_never_the_deterministic_mode():
    names = ["stock", "deterministic", "stock_fi", "tpo", "tpo_v1", "stock_eager_prefill"]
    passes = {"plain": {"stock": _p(40.0, 36.0, 38.0), "deterministic": _p(90.0, 90.0, 90.0), "tpo": _p(45.0, 44.0, 46.0),
                        "tpo_v1": _p(30.0, 31.0), "stock_eager_prefill": _p(50.0, 49.0, 51.0)},
              "qwen": {"stock": _p(30.0, 30.0, 30.0), "stock_fi": _p(35.0, 36.0, 34.0), "tpo": _p(28.0, 33.0, 29.0),
                       "tpo_v1": _p(), "stock_eager_prefill": _p(20.0, 20.0, 20.0), "deterministic": _p(99.0)}}
    res = results.summarize(passes, names, ["plain", "qwen"])
    plain = {r["variant"]: r for r in res["plain"]["rows"]}
    qwen = {r["variant"]: r for r in res["qwen"]["rows"]}
    assert res["plain"]["fastest_stock"] == "stock_eager_prefill" and res["qwen"]["fastest_stock"] == "stock_fi"
    assert "stock_fi" not in plain  # not run on plain: no row, not "not run"
    assert plain["tpo"]["median"] == 45.0 and plain["tpo_v1"]["median"] == 30.5  # the median of two is their mean
    assert plain["tpo"]["ratio_vs_stock"] == 45.0 / 38.0 and plain["tpo"]["ratio_vs_fastest_stock"] == 45.0 / 50.0
    assert qwen["tpo"]["ratio_vs_fastest_stock"] == 29.0 / 35.0 and qwen["tpo"]["ratio_vs_stock"] == 29.0 / 30.0
    assert qwen["tpo_v1"]["median"] is None and qwen["tpo_v1"]["ratio_vs_fastest_stock"] is None
    assert plain["tpo"]["passes"] == passes["plain"]["tpo"] and plain["tpo"]["tokens_per_s"] == [45.0, 44.0, 46.0]
    text = results.markdown(res, names)
    assert "| tpo | 45 (0.90x) | 29 (0.83x) |" in text and "| stock_fi | – | 35 (1.00x) |" in text
    assert "| fastest stock | stock_eager_prefill | stock_fi |" in text and "| tpo_v1 | 30 (0.61x) | not run |" in text
    passes["plain"]["stock_eager_prefill"] = []  # not run yet (a run cut short): the stock that ran is the bar
    res = results.summarize(passes, names, ["plain"])
    assert res["plain"]["fastest_stock"] == "stock" and res["plain"]["rows"][2]["ratio_vs_fastest_stock"] == 45.0 / 38.0


# ---------------------------------------------------------------- whole runs on stand-in variant processes


def _stand_ins(monkeypatch, tmp_path, cut_after=None, fail=(), seconds=1.0, tune=None):
    """main() on a stand-in checkpoint with stand-in variant processes (each pass takes ``seconds``
    on a stand-in clock; the ``cut_after``-th start raises as a time limit does; a variant in
    ``fail`` does not start). Returns the (variant, command) list asked and the starts."""
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"vocab_size": 300}))
    (model / "w.safetensors").write_bytes(b"0" * 1024)
    monkeypatch.setattr(geometries, "ensure", lambda name, room=False: str(model))
    monkeypatch.setattr(throughput, "free_gib", lambda: 100.0)
    monkeypatch.setattr(throughput, "wait_gpu_free", lambda total: None)
    clock = {"t": 0.0}
    monkeypatch.setattr(throughput, "_now", lambda: clock["t"])
    asked, starts = [], []

    class _V:
        def __init__(self, name, a, path, mem, names):
            starts.append(name)
            if cut_after is not None and len(starts) > cut_after:
                raise KeyboardInterrupt("the call's time limit")
            if name in fail:
                raise throughput.StartFailed(f"{name}: no flashinfer")
            tune_s = (tune or {}).pop(name, 0.0)  # a tuned stock's first start tunes its tiles (its start counts it)
            clock["t"] += 10.0 + tune_s
            self.name, self.workloads, self.engine, self.start_s, self.n = name, list(names), {"v": name}, 10.0 + tune_s, 0
            if tune_s:
                self.engine["moe_tuned"] = {"tune_s": tune_s}

        def ask(self, cmd):
            asked.append((self.name, cmd))
            self.n += 1
            took = seconds(cmd) if callable(seconds) else seconds
            clock["t"] += took
            return {"tokens_per_s": 100.0 * len(starts) + self.n, "tokens": 7, "seconds": took}

        def close(self):
            pass

    monkeypatch.setattr(throughput, "_Variant", _V)
    return asked, starts, clock


SPACE_ARGS = ["--geometry", "h3072e64k4", "--one-engine", "--repeats", "1", "--workload", "plain", "qwen", "tail",
              "long", "--variants", "stock", "stock_fi", "tpo", "tpo_v1", "--prompts", "8", "--min-prompt", "4",
              "--max-prompt", "9", "--new-tokens", "6"]


def test_a_space_run_writes_every_workload_pass_median_and_ratio(monkeypatch, tmp_path):
    out = tmp_path / "t.json"
    asked, starts, _ = _stand_ins(monkeypatch, tmp_path)
    assert throughput.main([*SPACE_ARGS, "--out", str(out)]) == 0
    d = json.loads(out.read_text())
    assert starts == ["stock", "stock_fi", "tpo", "tpo_v1"]  # one start each, variants in turn
    assert [c for v, c in asked if v == "stock_fi"] == ["warm qwen", "pass qwen 0", "pass qwen 1", "pass qwen 2"]
    assert [c for v, c in asked if v == "tpo"][:4] == ["warm plain", "pass plain 0", "pass plain 1", "pass plain 2"]
    assert d["complete"] and set(d["results"]) == {"plain", "qwen", "tail", "long"}
    counts = {w: {r["variant"]: len(r["passes"]) for r in d["results"][w]["rows"]} for w in d["results"]}
    assert counts["qwen"] == {"stock": 3, "stock_fi": 3, "tpo": 3, "tpo_v1": 3}
    assert counts["tail"] == counts["long"] == {"stock": 2, "tpo": 2, "tpo_v1": 2}
    assert d["results"]["qwen"]["fastest_stock"] == "stock_fi"  # started second: its stand-in passes are faster
    for res in d["results"].values():
        fastest = {r["variant"]: r["median"] for r in res["rows"]}[res["fastest_stock"]]
        for r in res["rows"]:
            assert r["median"] == statistics.median(r["tokens_per_s"]) and r["tokens_per_s"] == [
                p["tokens_per_s"] for p in r["passes"]]
            assert r["ratio_vs_fastest_stock"] == r["median"] / fastest
            assert all(set(p) == {"tokens_per_s", "tokens", "seconds", "start"} for p in r["passes"])
    tail = d["workloads"]["tail"]
    assert tail["new_tokens"] == wl.tail_lengths(8) and tail["passes_per_round"] == 2
    assert d["workloads"]["qwen"]["sampling"]["top_k"] == 20 and d["workloads"]["long"]["requests"] == 64
    assert d["geometry_record"]["spec"]["hidden_size"] == 3072 and d["geometry"] == "h3072e64k4"
    assert [s["variant"] for s in d["starts"]] == starts and set(d["starts"][0]["warmups"]) == set(wl.WORKLOADS)
    assert list(d["starts"][1]["warmups"]) == ["qwen"]
    assert d["engines"]["tpo_v1"]["contract"]["name"] == "qwen3_moe_true_on_policy_v1"
    assert d["engines"]["stock_fi"]["contract"] is None and d["failed"] == {}
    assert d["table"].startswith("| variant | plain | qwen | tail | long |") and "provenance" in d


def test_an_optional_stock_that_does_not_start_is_recorded_and_left_out(monkeypatch, tmp_path):
    out = tmp_path / "t.json"
    _stand_ins(monkeypatch, tmp_path, fail=("stock_fi",))
    assert throughput.main([*SPACE_ARGS, "--out", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["complete"] and "no flashinfer" in d["failed"]["stock_fi"] and d["results"]["qwen"]["fastest_stock"] == "stock"
    assert "stopped" not in d
    _stand_ins(monkeypatch, tmp_path, fail=("tpo",))
    with pytest.raises(throughput.StartFailed):  # the overlay not starting is never left out
        throughput.main([*SPACE_ARGS, "--out", str(out)])
    d = json.loads(out.read_text())  # the file says so: stock's passes kept, the run incomplete, and why
    assert not d["complete"] and d["failed"] == {}
    assert d["stopped"] == {"variant": "tpo", "error": "tpo: no flashinfer"}
    assert {r["variant"]: len(r["passes"]) for r in d["results"]["plain"]["rows"]}["stock"] == 3


def _decode_seconds(cmd: str) -> float:
    """A stand-in pass: 20 ms per decode step of the workload's longest request (the warm-up's capped)."""
    kind, w = cmd.split()[:2]
    longest = {"plain": 6, "qwen": 6, "tail": max(wl.tail_lengths(8)), "long": 4096}[w]
    return 0.02 * (min(longest, wl.WARM_CAP) if kind == "warm" else longest)


def test_the_time_budget_stops_between_passes_and_resume_finishes_the_run(monkeypatch, tmp_path):
    """Each stand-in start takes 10 s and each pass 20 ms per decode step (82 s for long): a budget
    of 150 s stops before what would end past it, workloads not yet timed included (exit 3); each
    call with --resume runs the next passes, none twice."""
    out = tmp_path / "t.json"
    args = [*SPACE_ARGS, "--resume", "--time-budget", "150", "--out", str(out)]
    calls, total = 0, []
    while True:
        asked, starts, clock = _stand_ins(monkeypatch, tmp_path, seconds=_decode_seconds)
        rc = throughput.main(args)
        calls += 1
        assert clock["t"] <= 150.0
        total += [(v, c) for v, c in asked if c.startswith("pass")]
        if rc == 0:
            break
        assert rc == throughput.EXIT_INCOMPLETE and not json.loads(out.read_text())["complete"]
        assert calls < 20
    d = json.loads(out.read_text())
    assert d["complete"] and calls > 2 and len(d["resumed_from"]) == calls - 1
    assert len(total) == len(set(total)) == 3 * (3 + 3 + 2 + 2) + 3  # every pass once, none repeated
    starts_of = {p["start"] for r in d["results"]["long"]["rows"] for p in r["passes"]}
    assert len(starts_of) >= 2 and len(d["starts"]) > 4  # resumed variants started again


def test_a_call_starts_no_engine_whose_round_would_not_finish_in_it(monkeypatch, tmp_path):
    """Stand-ins: 10 s a start, a tail pass 25 s. After stock's round (66 s) tpo's would end past the
    120 s budget: the call stops rather than start tpo, time its short workloads and leave the next
    call to start it again. The next call starts tpo once and finishes the run."""
    out = tmp_path / "t.json"
    args = ["--geometry", "h3072e64k4", "--one-engine", "--repeats", "1", "--workload", "plain", "qwen", "tail",
            "--variants", "stock", "tpo", "--prompts", "8", "--min-prompt", "4", "--max-prompt", "9",
            "--new-tokens", "6", "--resume", "--time-budget", "120", "--out", str(out)]
    _, starts, clock = _stand_ins(monkeypatch, tmp_path, seconds=_decode_seconds)
    assert throughput.main(args) == throughput.EXIT_INCOMPLETE
    assert starts == ["stock"] and clock["t"] < 120.0 - 10.0  # room for tpo's first pass, not for its round
    _, starts, clock = _stand_ins(monkeypatch, tmp_path, seconds=_decode_seconds)
    assert throughput.main(args) == 0 and starts == ["tpo"]
    d = json.loads(out.read_text())
    assert d["complete"] and len(d["starts"]) == 2
    assert {p["start"] for w in d["results"].values() for r in w["rows"] if r["variant"] == "tpo"
            for p in r["passes"]} == {1}


def test_resume_continues_a_cut_run_and_refuses_another(monkeypatch, tmp_path):
    out = tmp_path / "t.json"
    args = ["--one-engine", "--repeats", "1", "--passes", "2", "--variants", "stock", "tpo_v1", "tpo",
            "--out", str(out)]
    _stand_ins(monkeypatch, tmp_path, cut_after=1)
    with pytest.raises(KeyboardInterrupt):
        throughput.main(args)
    first = json.loads(out.read_text())
    assert not first["complete"] and [len(r["passes"]) for r in first["results"]["plain"]["rows"]] == [2, 0, 0]
    _, starts, _ = _stand_ins(monkeypatch, tmp_path)
    throughput.main([*args, "--resume"])
    done = json.loads(out.read_text())
    assert starts == ["tpo_v1", "tpo"]  # stock is not started again
    assert done["complete"] and done["results"]["plain"]["rows"][0]["passes"] == first["results"]["plain"]["rows"][0]["passes"]
    assert done["resumed_from"] == [first["provenance"]]
    from true_on_policy import DEFAULT_CONTRACT
    from true_on_policy.contract import get_contract

    main_c = get_contract(DEFAULT_CONTRACT)
    assert done["engines"]["tpo"] == {"v": "tpo", "start_s": 10.0,
                                      "contract": {"name": main_c.name, "fingerprint": main_c.fingerprint}}
    _, starts, _ = _stand_ins(monkeypatch, tmp_path)  # complete: run whole again, never merged
    throughput.main([*args, "--resume"])
    assert starts == ["stock", "tpo_v1", "tpo"] and "resumed_from" not in json.loads(out.read_text())
    prev = {**json.loads(out.read_text()), "complete": False}
    record = {k: prev[k] for k in ("geometry", "model_path", "new_tokens", "workloads", "variants")}
    assert throughput._not_resumable(prev, record) is None
    assert throughput._not_resumable(prev, {**record, "new_tokens": 999}) == "other arguments (new_tokens)"
    assert throughput._not_resumable({**prev, "complete": True}, record) == "it is complete"
    assert throughput._not_resumable({"provenance": {}, "rows": []}, record) == "it predates workloads"
    lease = {**prev["provenance"]["git"], "commit": "0" * 40, "dirty": True, "diff_sha256": "1" * 64}
    assert throughput._not_resumable({**prev, "provenance": {**prev["provenance"], "git": lease}}, record) is None
    other = {**prev["provenance"]["git"], "source_sha256": "2" * 64}
    assert throughput._not_resumable({**prev, "provenance": {**prev["provenance"], "git": other}}, record) == (
        "it ran from another source tree or other versions")
    with pytest.raises(SystemExit):
        throughput.main(["--resume", "--out", str(out)])


def test_shared_gpu_rounds_alternate_pass_by_pass(monkeypatch, tmp_path):
    asked, starts, _ = _stand_ins(monkeypatch, tmp_path)
    throughput.main(["--repeats", "2", "--variants", "stock", "tpo", "--workload", "plain", "tail"])
    assert starts == ["stock", "tpo"]
    assert [c for _, c in asked] == ["warm plain", "warm tail", "warm plain", "warm tail",
                                     "pass plain 0", "pass plain 0", "pass tail 0", "pass tail 0",
                                     "pass plain 1", "pass plain 1", "pass tail 1", "pass tail 1"]


def test_one_engine_traces_each_variant_once_after_its_last_timed_pass(monkeypatch, tmp_path):
    asked, _, _ = _stand_ins(monkeypatch, tmp_path)
    throughput.main(["--one-engine", "--repeats", "2", "--passes", "1", "--variants", "stock", "tpo",
                     "--trace", "/t"])
    assert [(v, c.split()[0]) for v, c in asked] == [
        ("stock", "warm"), ("stock", "pass"), ("tpo", "warm"), ("tpo", "pass"),
        ("stock", "warm"), ("stock", "pass"), ("stock", "trace"), ("tpo", "warm"), ("tpo", "pass"), ("tpo", "trace")]


def test_generation_config_serves_a_linked_sibling_with_those_defaults_and_leaves_the_checkpoint(tmp_path):
    ck = tmp_path / "ckpt"
    ck.mkdir()
    (ck / "config.json").write_text('{"vocab_size": 8}')
    (ck / "model.safetensors").write_bytes(b"w")
    (ck / "generation_config.json").write_text('{"bos_token_id": 1, "top_k": 50}')
    got = throughput.with_generation_config(str(ck), {"top_k": 20, "top_p": 0.95})
    assert json.loads((Path(got) / "generation_config.json").read_text()) == {
        "bos_token_id": 1, "top_k": 20, "top_p": 0.95, "do_sample": True}
    assert json.loads((ck / "generation_config.json").read_text()) == {"bos_token_id": 1, "top_k": 50}  # untouched
    assert (Path(got) / "model.safetensors").is_symlink() and (Path(got) / "model.safetensors").read_bytes() == b"w"
    assert throughput.with_generation_config(str(ck), {"top_k": 20, "top_p": 0.95}) == got
    assert throughput.with_generation_config(str(ck), {"top_k": 20, "top_p": 0.8}) != got


@pytest.mark.parametrize("bad", ['{"repetition_penalty": 1.1}', "[20]", "{}", "top_k=20"])
def test_generation_config_refuses_anything_but_sampling_keys(bad, capsys):
    with pytest.raises(SystemExit) as e:
        throughput.main(["--generation-config", bad])
    assert e.value.code == 2 and "--generation-config" in capsys.readouterr().err


def test_help_needs_no_gpu():
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "throughput.py"), "--help"], capture_output=True,
                       text=True, cwd=ROOT, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}, timeout=120)
    assert r.returncode == 0 and "--workload" in r.stdout and "tail" in r.stdout


def test_trace_gaps_counts_busy_idle_and_long_gaps(tmp_path):
    import gzip

    import trace_gaps

    ev = [{"ph": "X", "cat": "kernel", "ts": t, "dur": d} for t, d in ((0, 10), (5, 10), (30, 5), (100, 50))]
    ev += [{"ph": "X", "cat": "cpu_op", "ts": 0, "dur": 1000}, {"ph": "X", "cat": "gpu_memcpy", "ts": 150, "dur": 10}]
    r = trace_gaps.analyse(trace_gaps.gpu_intervals({"traceEvents": ev}), gap_us=20)
    assert r["gpu_events"] == 5 and r["window_ms"] == 0.16 and abs(r["busy_ms"] - 0.08) < 1e-12
    assert r["gaps_over_threshold"] == 1 and r["longest_gaps_us"] == [65.0]
    d = tmp_path / "stock"
    d.mkdir()
    with gzip.open(d / "1-TP-0.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": ev}, f)
    assert trace_gaps.run(str(tmp_path), 20)["stock"]["stock/1-TP-0.trace.json.gz"] == r
    assert trace_gaps.analyse([]) == {"gpu_events": 0}


# ---------------------------------------------------------------- the small-batch op profile


def _ev(cat, name, ts, dur=1.0, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, **({"args": args} if args else {})}


def _trace(extra=(), steps=2):
    """``steps`` annotated steps 100 µs apart, each with a GEMM, an attention kernel, an empty and a
    D2H copy; then the profiler's closing synchronize, outside every step."""
    ev = []
    for i in range(steps):
        t = 100.0 * i
        ev += [_ev("user_annotation", "tpo_profile_step", t, 50.0), _ev("kernel", "nvjet_gemm", t + 1, 10.0, grid=[4, 1, 1]),
               _ev("kernel", "_fwd_grouped_kernel_stage1", t + 12, 4.0), _ev("cpu_op", "aten::empty", t + 2),
               _ev("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", t + 20, 1.0)]
        ev += [dict(e, ts=e["ts"] + t) for e in extra]
    return ev + [_ev("cuda_runtime", "cudaDeviceSynchronize", 100.0 * steps + 5)]


def test_step_ops_counts_gpu_time_and_the_watched_events_inside_steps():
    import step_ops

    extra = [_ev("cpu_op", "aten::sort", 3), _ev("kernel", "void cub::DeviceRadixSortOnesweepKernel", 30, 2.0),
             _ev("cuda_runtime", "cudaStreamSynchronize", 4), _ev("cpu_op", "aten::item", 5),
             _ev("cuda_runtime", "cudaMalloc", 6), _ev("cuda_runtime", "cudaMemcpyAsync", 7)]
    r = step_ops.analyse(_trace(extra), steps=2)
    assert r["step_windows"] == 2 and r["gpu_us_per_step"] == 10.0 + 4.0 + 1.0 + 2.0
    assert r["kernels"][0] == {"kernel": "nvjet_gemm grid=[4, 1, 1]", "op": "dense GEMM", "us_per_step": 10.0,
                               "launches_per_step": 1.0}
    assert r["ops_us"]["attention"] == 4.0  # the triton decode kernel is attention, not "other"
    assert r["watched_per_step"] == {
        "allocation": {"cudaMalloc": 1.0},
        "device-to-host copy": {"Memcpy DtoH (Device -> Pinned)": 1.0},
        "host sync": {"aten::item": 1.0, "cudaStreamSynchronize": 1.0},  # not the closing cudaDeviceSynchronize
        "sort": {"aten::sort": 1.0, "void cub::DeviceRadixSortOnesweepKernel": 1.0},
        "tensor allocation": {"aten::empty": 1.0}}
    assert step_ops.op_of("fused_moe_kernel") == "MoE" and step_ops.op_of("mystery") == "other"


def _phase_result(variant, watched, workloads=("plain", "qwen"), batches=(1, 4)):
    row = {"gpu_us_per_step": 100.0, "ops_us": {"dense GEMM": 60.0, "attention": 40.0}, "kernels": [],
           "watched_per_step": watched, "step_ms": 0.5, "host_ms": {"prepare": 0.1, "forward": 0.3, "sample": 0.1}}
    dw = {w: {str(b): dict(row) for b in batches} for w in workloads}
    return {"variant": variant, "decode_workloads": dw, "decode": dw[workloads[0]],
            "prefill": {**row, "tokens": 64}, "contract": None}


def test_flags_name_what_a_contract_step_holds_beyond_each_stock():
    import step_ops

    stock = _phase_result("stock", {"sort": {"aten::sort": 1.0}, "tensor allocation": {"aten::empty": 3.0}})
    fi = _phase_result("stock_fi", {"tensor allocation": {"aten::empty": 3.0}})
    tpo = _phase_result("tpo", {"sort": {"aten::sort": 1.0}, "tensor allocation": {"aten::empty": 3.0}})
    v1 = _phase_result("tpo_v1", {"host sync": {"cudaStreamSynchronize": 1.0}, "tensor allocation": {"aten::empty": 5.0}})
    f = step_ops.flags([stock, fi, tpo, v1], engines.STOCK_EXTRA)
    got = {(x["variant"], x["against"], x["class"], x["kind"]) for x in f}
    assert got == {("tpo", "stock_fi", "sort", "absent in stock"), ("tpo_v1", "stock", "host sync", "absent in stock"),
                   ("tpo_v1", "stock_fi", "host sync", "absent in stock"),
                   ("tpo_v1", "stock", "tensor allocation", "more than stock"),
                   ("tpo_v1", "stock_fi", "tensor allocation", "more than stock")}
    assert len(f) == 5 * 2 * 2  # each pair at every workload and batch
    assert step_ops.flags([stock, tpo], engines.STOCK_EXTRA) == []


def test_op_profile_writes_the_table_and_flags_and_resumes_per_variant(monkeypatch, tmp_path):
    import op_profile

    model = tmp_path / "model"
    model.mkdir()
    monkeypatch.setattr(geometries, "ensure", lambda name, room=False: str(model))
    watched = {"stock": {}, "tpo": {"sort": {"aten::sort": 1.0}}, "tpo_v1": {}}
    ran = []

    def fake_run(cmd):
        v = cmd[cmd.index("--phase") + 1]
        ran.append(v)
        assert cmd[cmd.index("--batches") + 1:cmd.index("--batches") + 3] == ["1", "4"]
        if v == "tpo_v1" and len(ran) == 3:
            return SimpleNamespace(returncode=1, stdout="", stderr="the call's time limit")
        out = "RESULT " + json.dumps(_phase_result(v, watched[v]))
        return SimpleNamespace(returncode=0, stdout=f"{v} decode ...\n{out}\n", stderr="")

    monkeypatch.setattr(op_profile, "_run_phase", fake_run)
    out = tmp_path / "profile-tail.json"
    args = ["--geometry", "h1536e256k6", "--batches", "1", "4", "--variants", "stock", "tpo", "tpo_v1",
            "--workload", "plain", "qwen", "--mem", "0.85", "--resume", "--out", str(out)]
    with pytest.raises(RuntimeError, match="variant tpo_v1 failed"):
        op_profile.main(args)
    first = json.loads(out.read_text())
    assert not first["complete"] and [v["variant"] for v in first["variants"]] == ["stock", "tpo"]
    op_profile.main(args)
    assert ran == ["stock", "tpo", "tpo_v1", "tpo_v1"]  # stock and tpo kept, not run again
    d = json.loads(out.read_text())
    assert d["complete"] and d["workloads"] == ["plain", "qwen"] and d["batches"] == [1, 4] and d["mem"] == 0.85
    assert {(f["variant"], f["against"], f["workload"], f["batch"]) for f in d["flags"]} == {
        ("tpo", "stock", w, b) for w in ("plain", "qwen") for b in (1, 4)}
    md = d["table"]  # the tables live in the evidence file only: evidence/ holds .json and .log files
    assert not list(tmp_path.glob("*.md")) and "## decode step, batch 4, qwen" in md
    assert "| qwen | 4 | tpo | stock | sort | `aten::sort` | 1 | 0 |" in md
    assert "| total (GPU) | 100 | 100 | 100 | 1.00 | 1.00 |" in md
    assert d["geometry_record"]["spec"]["num_experts"] == 256
    with pytest.raises(SystemExit):
        op_profile.main(["--variants", "tpo", "stock"])  # the reference must be a stock variant


def test_step_ops_reads_a_real_torch_profiler_trace(tmp_path):
    """torch's own categories and annotations (CPU activity): a sort and a host read inside the
    steps count, the sort after them does not."""
    import step_ops
    import torch

    x = torch.randn(8, 100)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            with torch.profiler.record_function(step_ops.STEP):
                torch.sort(x, dim=-1).values[0, 0].item()
        torch.sort(x, dim=-1)
    prof.export_chrome_trace(str(tmp_path / "t.json"))
    r = step_ops.analyse_file(str(tmp_path / "t.json"), 2)
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    all_sorts = sum(e.get("name") == "aten::sort" for e in events)  # 3 calls (with their nested dispatch)
    assert r["step_windows"] == 2 and set(r["watched_per_step"]["sort"]) == {"aten::sort"}
    assert 2 * r["watched_per_step"]["sort"]["aten::sort"] == all_sorts * 2 / 3
    assert r["watched_per_step"]["host sync"]["aten::item"] == 1.0


def test_the_time_budget_counts_the_checkpoint_build(monkeypatch, tmp_path):
    """On a fresh host the checkpoint is built again before anything runs: that time counts."""
    out = tmp_path / "t.json"
    args = [*SPACE_ARGS, "--resume", "--time-budget", "150", "--out", str(out)]
    _stand_ins(monkeypatch, tmp_path, seconds=_decode_seconds)
    assert throughput.main(args) == throughput.EXIT_INCOMPLETE
    for build_s, ran in ((100.0, False), (0.0, True)):
        asked, starts, clock = _stand_ins(monkeypatch, tmp_path, seconds=_decode_seconds)
        model = geometries.ensure("h3072e64k4")
        monkeypatch.setattr(geometries, "ensure", lambda name, room=False, b=build_s, c=clock, m=model: (
            c.__setitem__("t", c["t"] + b), m)[1])
        assert throughput.main(args) == throughput.EXIT_INCOMPLETE
        assert clock["t"] <= 150.0 and bool(starts) == ran  # after a 100 s build, the next start does not fit


def test_a_moe_tuning_in_one_start_is_not_expected_of_the_next(monkeypatch, tmp_path):
    """Stand-ins: 10 s a start, plus 200 s of MoE tuning in stock_moe's (done once per checkpoint), 20 ms a
    decode step. Under a 400 s budget, after stock_moe's round the next engine's start is estimated at
    10 s, not 210 s: the call goes on to start tpo and finishes the run."""
    out = tmp_path / "t.json"
    args = ["--geometry", "h3072e64k4", "--one-engine", "--repeats", "1", "--workload", "plain", "tail",
            "--variants", "stock_moe", "tpo", "--prompts", "8", "--min-prompt", "4", "--max-prompt", "9",
            "--new-tokens", "6", "--resume", "--time-budget", "400", "--out", str(out)]
    _, starts, clock = _stand_ins(monkeypatch, tmp_path, seconds=_decode_seconds, tune={"stock_moe": 200.0})
    assert throughput.main(args) == 0 and starts == ["stock_moe", "tpo"] and clock["t"] <= 400.0
    d = json.loads(out.read_text())
    assert d["complete"] and d["starts"][0]["tune_s"] == 200.0 and d["starts"][0]["start_s"] == 210.0
    assert "tune_s" not in d["starts"][1]
    # the estimate with the tuning counted (210 s: tpo's round would not fit) and without it
    run = throughput.Run.__new__(throughput.Run)
    run.starts = [dict(d["starts"][0], tune_s=None), d["starts"][1]]
    assert run.start_estimate() == 210.0
    run.starts = d["starts"]
    assert run.start_estimate() == 10.0


def test_a_step_longer_than_the_whole_budget_stops_with_its_estimate(monkeypatch, tmp_path, capsys):
    """Stand-ins: 10 s a start, 20 ms a decode step. ``long`` not timed yet is estimated from the
    slowest step seen: 4,096 steps x 20 ms x 1.5 = 123 s, more than a 100 s budget, so no call under
    it can run one. The calls run what fits, then stop with exit 4 and the estimate instead of asking
    for another call (which would run nothing); a budget that holds the step finishes the run."""
    out = tmp_path / "t.json"
    args = [*SPACE_ARGS, "--resume", "--out", str(out)]
    for _ in range(20):
        _stand_ins(monkeypatch, tmp_path, seconds=_decode_seconds)
        rc = throughput.main([*args, "--time-budget", "100"])
        if rc != throughput.EXIT_INCOMPLETE:
            break
    assert rc == throughput.EXIT_STALLED
    printed = capsys.readouterr().out
    assert "STALLED: the next step is estimated at 131 s, more than the whole --time-budget of 100.0 s" in printed
    d = json.loads(out.read_text())
    assert not d["complete"] and not any(r["passes"] for r in d["results"]["long"]["rows"])
    assert len(d["results"]["tail"]["rows"][0]["passes"]) == 2  # stock's shorter workloads ran
    asked, starts, _ = _stand_ins(monkeypatch, tmp_path, seconds=_decode_seconds)
    assert throughput.main([*args, "--time-budget", "100"]) == throughput.EXIT_STALLED and not asked
    before = {w: {r["variant"]: len(r["passes"]) for r in res["rows"]} for w, res in d["results"].items()}
    passes = []
    for _ in range(20):
        asked, _, _ = _stand_ins(monkeypatch, tmp_path, seconds=_decode_seconds)
        rc = throughput.main([*args, "--time-budget", "300"])
        passes += [(v, c) for v, c in asked if c.startswith("pass")]
        if rc != throughput.EXIT_INCOMPLETE:
            break
    assert rc == 0 and json.loads(out.read_text())["complete"]
    assert len(passes) == len(set(passes)) == 3 * (3 + 3 + 2 + 2) + 3 - sum(sum(v.values()) for v in before.values())


def test_a_tpo_variant_records_what_each_schedulers_graph_capture_chose():
    """The engine record of an overlay variant holds each scheduler manifest's ``cuda_graph`` entry
    (the decode attention's chosen tiles and the seconds the choice took; ``tpo_fixed``: none, the fixed tile)."""
    record = {"decode_batch_sizes": [1, 2], "decode_tiles": [{"heads": [24, 6, 128], "tiles": {"1": None}}],
              "decode_tiles_s": 4.2}
    eng = SimpleNamespace(manifests=lambda: [{"role": "scheduler", "extra": {"cuda_graph": record}},
                                             {"role": "tokenizer", "extra": {}}, {"role": "scheduler"}])
    from true_on_policy import manifest

    assert manifest.captured_graphs(eng.manifests()) == [record, {}]
    assert engines.TPO_ENV["tpo_tiles"] == {"TRUE_ON_POLICY_DECODE_TILES": "choose"}
    assert engines.TPO_ENV["tpo_fixed"] == {"TRUE_ON_POLICY_DECODE_TILES": "fixed"}
    assert engines.TPO_ENV["tpo_qknr"] == {"TRUE_ON_POLICY_QK_NORM_ROPE": "fused"}
    assert engines.TPO_ENV["tpo_qksep"] == {"TRUE_ON_POLICY_QK_NORM_ROPE": "separate"}
    assert engines.TPO_ENV["tpo_silusep"] == {"TRUE_ON_POLICY_MOE_SILU": "separate"}
    assert engines.TPO_ENV["tpo_siluup"] == {"TRUE_ON_POLICY_MOE_SILU": "up"}
    assert engines.TPO_ENV["tpo_pflat"] == {"TRUE_ON_POLICY_PREFILL_LOOP": "flat"}
    assert engines.TPO_ENV["tpo_pchoose"] == {"TRUE_ON_POLICY_PREFILL_LOOP": "choose"}
    for v in ("tpo_tiles", "tpo_fixed", "tpo_qknr", "tpo_qksep", "tpo_silusep", "tpo_siluup", "tpo_pflat", "tpo_pchoose"):
        assert v in throughput.VARIANTS and engines.variant_contract(v) == engines.variant_contract("tpo")
    assert engines.TPO_ENV["tpo_v1_segtma"] == {"TRUE_ON_POLICY_SEG_TMA": "tma"}  # v1 with the TMA tree down projection
    assert "tpo_v1_segtma" in throughput.VARIANTS
    assert engines.variant_contract("tpo_v1_segtma") == engines.variant_contract("tpo_v1")
    # the MoE GEMMs' tiles above the decode path by the token count, beside the default (by the rows per expert)
    assert engines.TPO_ENV["tpo_moetok"] == engines.TPO_ENV["tpo_v1_moetok"] == {"TRUE_ON_POLICY_MOE_TILES": "tokens"}
    assert {"tpo_moetok", "tpo_v1_moetok"} <= set(throughput.VARIANTS)
    assert engines.variant_contract("tpo_moetok") == engines.variant_contract("tpo")
    assert engines.variant_contract("tpo_v1_moetok") == engines.variant_contract("tpo_v1")
    # the MoE GEMMs' programs in the column order, beside the default (in groups of M blocks)
    assert engines.TPO_ENV["tpo_moecol"] == engines.TPO_ENV["tpo_v1_moecol"] == {"TRUE_ON_POLICY_MOE_ORDER": "columns"}
    assert {"tpo_moecol", "tpo_v1_moecol"} <= set(throughput.VARIANTS)
    assert engines.variant_contract("tpo_moecol") == engines.variant_contract("tpo")
    assert engines.variant_contract("tpo_v1_moecol") == engines.variant_contract("tpo_v1")
    # v1 with the tree down projection's fixed tile above the decode path (the default: by the rows per expert)
    assert engines.TPO_ENV["tpo_v1_treefixed"] == {"TRUE_ON_POLICY_TREE_TILE": "fixed"}
    assert "tpo_v1_treefixed" in throughput.VARIANTS
    assert engines.variant_contract("tpo_v1_treefixed") == engines.variant_contract("tpo_v1")
