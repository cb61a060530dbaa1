"""CPU tier: the throughput benchmark's variant process answers warm/pass/quit and reports what
its engine got (the engine is a stand-in; the GPU run is ``regenerate_evidence.sh bench``)."""

import io
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import throughput  # noqa: E402


class _Eng:
    def __init__(self, flush_ok=(True,)):
        self.shut = False
        self.calls = []  # "flush" / "generate", in order
        self.flush_ok = list(flush_ok)

    def flush_cache(self):
        self.calls.append("flush")
        return type("FlushCacheReqOutput", (), {"success": self.flush_ok.pop(0) if self.flush_ok else True})()

    def get_server_info(self):
        return {"max_total_num_tokens": 123456, "cuda_graph_max_bs": 256, "chunked_prefill_size": 8192,
                "max_running_requests": 2048, "unrelated": "x"}

    def generate(self, input_ids, sampling_params, return_logprob):
        self.calls.append("generate")
        return [{"meta_info": {"completion_tokens": p["max_new_tokens"]}} for p in sampling_params]

    def start_profile(self, **req):
        self.calls.append(("profile", req["output_dir"], req["num_steps"]))

    def shutdown(self):
        self.shut = True


def _serve(monkeypatch, tmp_path, capsys, name, commands, **kw):
    """The variant process ``serve`` on a stand-in engine, fed ``commands`` on stdin; returns the
    engine and the RESULT lines it printed."""
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 300}))
    eng = _Eng()
    monkeypatch.setattr(throughput, "_engine", lambda name, path, mem: eng)
    monkeypatch.setattr(sys, "stdin", io.StringIO(commands))
    throughput.serve(name, str(tmp_path), 4, 8, 16, 5, 0.5, **kw)
    lines = [json.loads(x[len("RESULT "):]) for x in capsys.readouterr().out.splitlines() if x.startswith("RESULT ")]
    return eng, lines


def test_variant_process_reports_engine_and_passes(monkeypatch, tmp_path, capsys):
    eng, lines = _serve(monkeypatch, tmp_path, capsys, "tpo", "warm\npass 0\nquit\n")
    assert lines[0]["ready"] == "tpo" and lines[0]["engine"]["max_total_num_tokens"] == 123456
    assert set(lines[0]["engine"]) == set(throughput.ENGINE_KEYS)
    assert [x["cmd"] for x in lines[1:]] == [["warm"], ["pass", "0"]] and all(x["tokens"] == 20 for x in lines[1:])
    assert eng.shut
    assert eng.calls == ["flush", "generate", "flush", "generate"]  # cold (the default): every pass computes its prompts


def test_warm_prefix_cache_never_flushes_and_a_failed_flush_is_retried_then_raises(monkeypatch, tmp_path, capsys):
    warm, _ = _serve(monkeypatch, tmp_path, capsys, "stock", "warm\npass 0\nquit\n", cold=False)
    assert warm.calls == ["generate", "generate"]
    monkeypatch.setattr(throughput.time, "sleep", lambda s: None)
    busy = _Eng(flush_ok=(False, False, True))  # SGLang refuses while a request is in flight
    throughput._flush(busy)
    assert busy.calls == ["flush"] * 3
    never = _Eng(flush_ok=(False,) * 5)
    with pytest.raises(RuntimeError, match="flush_cache did not succeed"):
        throughput._flush(never, tries=5)


def _one_engine_stand_ins(monkeypatch) -> list:
    """Variant processes that answer every command at once, a GPU that is always free; returns
    the (variant, command word) list the stand-ins are asked, in order."""
    asked = []

    class _V:
        def __init__(self, name, a, path, mem):
            self.name, self.engine = name, {"v": name}

        def ask(self, cmd):
            asked.append((self.name, cmd.split()[0]))
            return {"tokens_per_s": 1.0, "tokens": 1}

        def close(self):
            pass

    monkeypatch.setattr(throughput, "_Variant", _V)
    monkeypatch.setattr(throughput, "_free_gb", lambda: 100.0)
    monkeypatch.setattr(throughput, "_wait_gpu_free", lambda total: None)
    return asked


def test_one_engine_rounds_report_after_every_variant(monkeypatch):
    """--one-engine: the evidence is rewritten after each variant, not only after each round, so a
    call cut short by its time limit keeps the variants it timed (marked incomplete)."""
    from types import SimpleNamespace

    _one_engine_stand_ins(monkeypatch)
    a = SimpleNamespace(repeats=2, variants=["stock", "deterministic", "tpo"], passes=3, mem=0.85, trace=None)
    passes, seen = {v: [] for v in a.variants}, []
    throughput._one_engine_rounds(a, "m", passes, {}, {}, lambda done: seen.append((done, [len(passes[v]) for v in a.variants])))
    assert seen == [(0, [3, 0, 0]), (0, [3, 3, 0]), (1, [3, 3, 3]), (1, [6, 3, 3]), (1, [6, 6, 3]), (2, [6, 6, 6])]


def test_stock_variants_differ_only_in_their_named_argument(monkeypatch):
    """Every stock variant is triton attention + pytorch sampling; "deterministic" adds SGLang's
    deterministic mode and "stock_eager_prefill" turns its prefill CUDA graphs off, nothing else."""
    import sglang

    from true_on_policy import env

    seen = {}
    monkeypatch.setattr(sglang, "Engine", lambda **kw: kw)
    monkeypatch.setattr(env, "disable_overlay", lambda: None)
    for name in throughput.STOCK_EXTRA:
        seen[name] = throughput._engine(name, "/m", 0.5)
    base = seen["stock"]
    assert base["attention_backend"] == "triton" and base["sampling_backend"] == "pytorch"
    assert {k: v for k, v in seen["deterministic"].items() if base.get(k) != v} == {"enable_deterministic_inference": True}
    assert {k: v for k, v in seen["stock_eager_prefill"].items() if base.get(k) != v} == {
        "cuda_graph_backend_prefill": "disabled"}
    assert "stock_eager_prefill" in throughput.VARIANTS


def test_http_engine_runs_the_servers_users_run_and_sends_one_request_per_prompt(monkeypatch, tmp_path):
    """--http: tpo variants start ``launch.server --true-on-policy`` (the flat one with its
    contract), stock ones ``sglang.launch_server`` with the Engine's flags and no overlay in their
    environment; a pass posts every prompt as its own /generate request, concurrently; the cache
    is emptied through /flush_cache (a refusal reads as not flushed). A local stand-in answers."""
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

    def popen(cmd, **kw):
        cmds.append((cmd, kw["env"]))
        return _Proc()

    monkeypatch.setattr(throughput.subprocess, "Popen", popen)
    monkeypatch.setattr(throughput.os, "killpg", lambda pid, sig: None)
    from true_on_policy import env

    monkeypatch.setenv(env.ENABLED.name, "1")  # the caller's shell has the overlay on
    try:
        port = srv.server_address[1]
        for name in ("tpo_flat", "deterministic"):
            eng = throughput.HttpEngine(name, "/m", 0.5, port=port)
            if name == "tpo_flat":
                outs = eng.generate([[1, 2], [3], [4, 5, 6]], [{"max_new_tokens": n} for n in (2, 3, 4)], True)
                assert [o["meta_info"]["completion_tokens"] for o in outs] == [2, 3, 4]
                assert sorted(len(b["input_ids"]) for b in seen) == [1, 2, 3] and all(b["return_logprob"] for b in seen)
                assert [eng.flush_cache().success, eng.flush_cache().success] == [False, True]
                assert eng.get_server_info()["max_total_num_tokens"] == 99
            eng.shutdown()
    finally:
        srv.shutdown()
    (tpo_cmd, _), (stock_cmd, stock_env) = cmds
    assert tpo_cmd[1:5] == ["-m", "launch.server", "--true-on-policy", "--true-on-policy-contract"]
    assert tpo_cmd[5] == throughput.FLAT and tpo_cmd[tpo_cmd.index("--port") + 1] == str(port)
    assert stock_cmd[1:3] == ["-m", "sglang.launch_server"] and "--enable-deterministic-inference" in stock_cmd
    assert stock_cmd[stock_cmd.index("--attention-backend") + 1] == "triton"
    assert env.ENABLED.name not in stock_env
    assert throughput._flags({"cuda_graph_backend_prefill": "disabled", "x_y": True}) == [
        "--cuda-graph-backend-prefill", "disabled", "--x-y"]


def test_trace_command_profiles_one_untimed_pass(monkeypatch, tmp_path, capsys):
    eng, lines = _serve(monkeypatch, tmp_path, capsys, "tpo", "pass 0\ntrace /t/tpo 40\nquit\n")
    assert eng.calls == ["flush", "generate", ("profile", "/t/tpo", 40), "flush", "generate"]
    assert lines[-1]["cmd"] == ["trace", "/t/tpo", "40"]


def test_trace_gaps_counts_busy_idle_and_long_gaps(tmp_path):
    import gzip

    import trace_gaps

    ev = [{"ph": "X", "cat": "kernel", "ts": t, "dur": d} for t, d in ((0, 10), (5, 10), (30, 5), (100, 50))]
    ev += [{"ph": "X", "cat": "cpu_op", "ts": 0, "dur": 1000}, {"ph": "X", "cat": "gpu_memcpy", "ts": 150, "dur": 10}]
    r = trace_gaps.analyse(trace_gaps.gpu_intervals({"traceEvents": ev}), gap_us=20)
    # busy: [0,15] + [30,35] + [100,150] + [150,160] = 15 + 5 + 60; window 160; gaps 15 and 65
    assert r["gpu_events"] == 5 and r["window_ms"] == 0.16 and abs(r["busy_ms"] - 0.08) < 1e-12
    assert r["gaps_over_threshold"] == 1 and r["longest_gaps_us"] == [65.0]
    d = tmp_path / "stock"
    d.mkdir()
    with gzip.open(d / "1-TP-0.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": ev}, f)
    rows = trace_gaps.run(str(tmp_path), 20)
    assert rows["stock"]["stock/1-TP-0.trace.json.gz"] == r
    assert trace_gaps.analyse([]) == {"gpu_events": 0}


def test_one_engine_rounds_trace_each_variant_once_after_its_last_timed_pass(monkeypatch):
    from types import SimpleNamespace

    asked = _one_engine_stand_ins(monkeypatch)
    a = SimpleNamespace(repeats=2, variants=["stock", "tpo"], passes=1, mem=0.85, trace="/t", trace_steps=5)
    throughput._one_engine_rounds(a, "m", {v: [] for v in a.variants}, {}, {}, lambda done: None)
    assert asked == [("stock", "warm"), ("stock", "pass"), ("tpo", "warm"), ("tpo", "pass"),
                     ("stock", "warm"), ("stock", "pass"), ("stock", "trace"),
                     ("tpo", "warm"), ("tpo", "pass"), ("tpo", "trace")]


def test_ratios_are_taken_against_the_faster_stock_and_never_the_deterministic_mode():
    def p(*tps):
        return [{"tokens_per_s": x, "tokens": 100} for x in tps]

    names = ["stock", "deterministic", "tpo_flat", "stock_eager_prefill"]
    passes = {"stock": p(40.0, 36.0, 38.0), "deterministic": p(90.0, 90.0, 90.0), "tpo_flat": p(45.0, 44.0, 46.0),
              "stock_eager_prefill": p(50.0, 49.0, 51.0)}
    rows, fastest = throughput.table(passes, names)
    by = {r["variant"]: r for r in rows}
    assert fastest == "stock_eager_prefill"
    assert by["tpo_flat"]["median"] == 45.0
    assert by["tpo_flat"]["ratio_vs_stock"] == 45.0 / 38.0
    assert by["tpo_flat"]["ratio_vs_fastest_stock"] == 45.0 / 50.0
    passes["stock_eager_prefill"] = []  # not run yet (a run cut short): the one stock that ran is the bar
    rows, fastest = throughput.table(passes, names)
    assert fastest == "stock" and rows[2]["ratio_vs_fastest_stock"] == 45.0 / 38.0
    assert rows[3]["median"] is None and rows[3]["ratio_vs_fastest_stock"] is None


def _main_stand_ins(monkeypatch, tmp_path, cut_after=None):
    """main() with stand-in variants (as _one_engine_stand_ins) on a stand-in checkpoint; the
    ``cut_after``-th engine start raises, as a device call's time limit cuts a run."""
    from true_on_policy.harness import tiny_model

    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "w.safetensors").write_bytes(b"0" * 1024)
    monkeypatch.setattr(tiny_model, "ensure", lambda geometry: str(model))
    asked = _one_engine_stand_ins(monkeypatch)
    starts = []
    cls = throughput._Variant

    class _Cut(cls):
        def __init__(self, name, a, path, mem):
            starts.append(name)
            if cut_after is not None and len(starts) > cut_after:
                raise KeyboardInterrupt("the call's time limit")
            super().__init__(name, a, path, mem)
            self.n, self.start_s = 0, 12.34

        def ask(self, cmd):
            super().ask(cmd)
            self.n += 1
            return {"tokens_per_s": 100.0 * len(starts) + self.n, "tokens": 7}

    monkeypatch.setattr(throughput, "_Variant", _Cut)
    return asked, starts


def test_resume_continues_a_cut_run_with_only_its_missing_variants_and_lists_every_start(monkeypatch, tmp_path):
    out = tmp_path / "t.json"
    args = ["--one-engine", "--repeats", "1", "--passes", "2", "--variants", "stock", "tpo_v1", "tpo",
            "--out", str(out)]
    _, starts = _main_stand_ins(monkeypatch, tmp_path, cut_after=1)
    with pytest.raises(KeyboardInterrupt):
        throughput.main(args)
    first = json.loads(out.read_text())
    assert not first["complete"] and [len(r["tokens_per_s"]) for r in first["rows"]] == [2, 0, 0]
    _, starts = _main_stand_ins(monkeypatch, tmp_path)
    throughput.main([*args, "--resume"])
    done = json.loads(out.read_text())
    assert starts == ["tpo_v1", "tpo"]  # stock is not started again
    assert done["complete"] and [len(r["tokens_per_s"]) for r in done["rows"]] == [2, 2, 2]
    assert done["rows"][0]["tokens_per_s"] == first["rows"][0]["tokens_per_s"]
    assert done["resumed_from"] == [first["provenance"]]
    from true_on_policy import DEFAULT_CONTRACT
    from true_on_policy.contract import get_contract

    main_c, v1_c = (get_contract(n) for n in (DEFAULT_CONTRACT, "qwen3_moe_true_on_policy_v1"))
    # what it resolved, the contract it ran under (tpo: the default, the flat one), and its start time
    assert done["engines"]["tpo"] == {"v": "tpo", "start_s": 12.3,
                                      "contract": {"name": main_c.name, "fingerprint": main_c.fingerprint}}
    assert main_c.name == throughput.FLAT
    assert done["engines"]["tpo_v1"]["contract"] == {"name": v1_c.name, "fingerprint": v1_c.fingerprint}
    assert done["engines"]["stock"]["contract"] is None and main_c.fingerprint != v1_c.fingerprint
    # a complete run, or one of other arguments, is run whole again, never merged
    _, starts = _main_stand_ins(monkeypatch, tmp_path)
    throughput.main([*args, "--resume"])
    assert starts == ["stock", "tpo_v1", "tpo"] and "resumed_from" not in json.loads(out.read_text())


def test_resume_refuses_another_workload_and_needs_one_engine_and_out(monkeypatch, tmp_path):
    out = tmp_path / "t.json"
    args = ["--one-engine", "--repeats", "1", "--passes", "1", "--variants", "stock", "tpo", "--out", str(out)]
    _main_stand_ins(monkeypatch, tmp_path, cut_after=1)
    with pytest.raises(KeyboardInterrupt):
        throughput.main(args)
    prev = json.loads(out.read_text())
    assert throughput._not_resumable(prev, {"geometry": prev["geometry"], "new_tokens": 999}) == \
        "other arguments (new_tokens)"
    assert throughput._not_resumable({**prev, "complete": True}, {}) == "it is complete"
    with pytest.raises(SystemExit):
        throughput.main(["--resume", "--out", str(out)])


def test_generation_config_serves_a_linked_sibling_with_those_defaults_and_leaves_the_checkpoint(tmp_path):
    ck = tmp_path / "ckpt"
    ck.mkdir()
    (ck / "config.json").write_text('{"vocab_size": 8}')
    (ck / "model.safetensors").write_bytes(b"w")
    (ck / "generation_config.json").write_text('{"bos_token_id": 1, "top_k": 50}')
    got = throughput.with_generation_config(str(ck), {"top_k": 20, "top_p": 0.95})
    gen = json.loads((Path(got) / "generation_config.json").read_text())
    assert gen == {"bos_token_id": 1, "top_k": 20, "top_p": 0.95, "do_sample": True}
    assert json.loads((ck / "generation_config.json").read_text()) == {"bos_token_id": 1, "top_k": 50}  # untouched
    assert (Path(got) / "model.safetensors").is_symlink() and (Path(got) / "model.safetensors").read_bytes() == b"w"
    assert sorted(p.name for p in Path(got).iterdir()) == sorted(p.name for p in ck.iterdir())
    assert throughput.with_generation_config(str(ck), {"top_k": 20, "top_p": 0.95}) == got  # same content, same folder
    assert throughput.with_generation_config(str(ck), {"top_k": 20, "top_p": 0.8}) != got


@pytest.mark.parametrize("bad", ['{"repetition_penalty": 1.1}', "[20]", "{}", "top_k=20"])
def test_generation_config_refuses_anything_but_sampling_keys(bad, capsys):
    with pytest.raises(SystemExit) as e:
        throughput.main(["--generation-config", bad])
    assert e.value.code == 2 and "--generation-config" in capsys.readouterr().err


def test_the_workload_record_names_the_generation_config(monkeypatch, tmp_path):
    out = tmp_path / "t.json"
    _main_stand_ins(monkeypatch, tmp_path)
    throughput.main(["--one-engine", "--repeats", "1", "--passes", "1", "--variants", "stock", "--out", str(out),
                     "--generation-config", '{"top_k": 20, "top_p": 0.95}'])
    done = json.loads(out.read_text())
    assert done["generation_config"] == {"top_k": 20, "top_p": 0.95}
    assert done["model_path"].startswith(str(tmp_path / "model") + "-gen-")


def test_each_tpo_variant_runs_the_contract_it_is_recorded_under(monkeypatch):
    """The Engine and the server of every overlay variant get the contract ``variant_contract``
    records (the default one where none is named); the prefill-graph previews run only when named."""
    from true_on_policy import DEFAULT_CONTRACT
    from true_on_policy.rollout import engine as eng_mod

    monkeypatch.setattr(eng_mod, "TrueOnPolicyEngine", lambda **kw: kw)
    popen = []
    monkeypatch.setattr(throughput.subprocess, "Popen", lambda cmd, **kw: popen.append(cmd) or None)
    monkeypatch.setattr(throughput.HttpEngine, "_wait_up", lambda self, t: None)
    for name in (v for v in throughput.VARIANTS if v not in throughput.STOCK_EXTRA):
        want = throughput.variant_contract(name)["name"]
        assert want == throughput.CONTRACTS.get(name, DEFAULT_CONTRACT)
        assert throughput._engine(name, "/m", 0.5).get("contract", DEFAULT_CONTRACT) == want
        throughput.HttpEngine(name, "/m", 0.5, port=1)
        cmd = popen[-1]
        got = cmd[cmd.index("--true-on-policy-contract") + 1] if "--true-on-policy-contract" in cmd else DEFAULT_CONTRACT
        assert got == want, (name, cmd)
    assert {"tpo_pg", "tpo_flat_pg"}.isdisjoint(throughput.DEFAULT_VARIANTS)
    assert throughput.variant_contract("tpo_flat_pg")["name"] == "qwen3_moe_true_on_policy_flat_pg_preview_v1"
