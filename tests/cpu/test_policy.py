"""Runtime policy against the real, installed sglang 0.5.17 (resolution needs no GPU)."""

import json
from functools import partial

import pytest

from true_on_policy import tiny_model
from true_on_policy.contract import get_contract, launch_plan
from true_on_policy.contract.policy import PolicyError, check_env, check_model, check_versions

C = get_contract("qwen3_moe_true_on_policy_v1")
# as the launchers call them: without --model-path / model_path, the embedded model
build_plan = partial(launch_plan.build_plan, default_model=tiny_model.ensure)
build_plan_from_kwargs = partial(launch_plan.build_plan_from_kwargs, default_model=tiny_model.ensure)


def _subjects(err: PolicyError) -> set[str]:
    return {v.subject for v in err.violations}


def test_valid_plan_resolves_forced_args(tiny_cache, clean_env):
    plan = build_plan(C, [])
    sa = plan.server_args
    assert plan.embedded_model
    for rule in C.args:
        if rule.forced:
            assert getattr(sa, rule.dest) == rule.force, rule.dest
    assert plan.env["NCCL_NVLS_ENABLE"] == "0"


def test_without_a_model_path_or_a_default_model_the_plan_names_the_flag(clean_env):
    """The contract layer builds no checkpoint: the embedded model is the launchers' default,
    handed down; without one, a missing --model-path is a refusal naming the flag."""
    for plan in (lambda: launch_plan.build_plan(C, []), lambda: launch_plan.build_plan_from_kwargs(C, {})):
        with pytest.raises(PolicyError) as e:
            plan()
        assert _subjects(e.value) == {"--model-path"}, str(e.value)


@pytest.mark.parametrize("argv, subject", [
    (["--attention-backend", "fa3"], "--attention-backend"),
    (["--quantization", "fp8"], "--quantization"),
    (["--enable-dp-attention", "--dp-size", "2", "--tp-size", "2"], "--enable-dp-attention"),
    (["--tp-size", "3"], "--tp-size"),
    (["--enable-mixed-chunk"], "--enable-mixed-chunk"),
    (["--enable-torch-compile"], "--enable-torch-compile"),
    (["--kv-cache-dtype", "fp8_e4m3"], "--kv-cache-dtype"),
    (["--enable-nccl-nvls"], "--enable-nccl-nvls"),
    (["--enable-symm-mem"], "--enable-symm-mem"),
    (["--moe-a2a-backend", "deepep"], "--moe-a2a-backend"),
    (["--speculative-algorithm", "EAGLE"], "--speculative-algorithm"),
    (["--tp-size", "2"], "--tp-size"),
    (["--ep-size", "2"], "--ep-size"),
    (["--pp-size", "2"], "--pp-size"),
    (["--use-ray"], "--use-ray"),
    (["--chunked-prefill-size", "100"], "--chunked-prefill-size"),
])
def test_each_forbidden_input_is_caught(tiny_cache, clean_env, argv, subject):
    with pytest.raises(PolicyError) as e:
        build_plan(C, argv)
    assert subject in _subjects(e.value), str(e.value)


def test_all_violations_listed_at_once(tiny_cache, clean_env):
    clean_env.setenv("NCCL_NVLS_ENABLE", "1")
    clean_env.setenv("SGLANG_PLUGINS", "someone_else")
    with pytest.raises(PolicyError) as e:
        build_plan(C, ["--attention-backend", "fa3", "--quantization", "fp8", "--enable-mixed-chunk",
                       "--enable-torch-compile", "--tp-size", "3"])
    got = _subjects(e.value)
    assert {"NCCL_NVLS_ENABLE", "SGLANG_PLUGINS"} <= got  # env is checked before SGLang resolves
    msg = str(e.value)
    assert "violation(s)" in msg and "nothing was started" in msg


def test_resolved_violations_listed_together(tiny_cache, clean_env):
    with pytest.raises(PolicyError) as e:
        build_plan(C, ["--attention-backend", "fa3", "--quantization", "fp8", "--enable-mixed-chunk",
                       "--enable-torch-compile", "--tp-size", "3"])
    assert {"--attention-backend", "--quantization", "--enable-mixed-chunk", "--enable-torch-compile",
            "--tp-size"} <= _subjects(e.value)


def test_kwargs_plan_rejects_contradicting_forced_value(tiny_cache, clean_env):
    with pytest.raises(PolicyError) as e:
        build_plan_from_kwargs(C, {"attention_backend": "flashinfer", "enable_mixed_chunk": True})
    assert {"--attention-backend", "--enable-mixed-chunk"} <= _subjects(e.value)
    plan = build_plan_from_kwargs(C, {"mem_fraction_static": 0.3})
    assert plan.server_args.attention_backend == "triton"


def test_wrong_model_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    [v] = check_model(C, str(tmp_path))
    assert "LlamaForCausalLM" in v.found and "Qwen3MoeForCausalLM" in v.fix
    [missing] = check_model(C, str(tmp_path / "nope"))
    assert missing.subject == "--model-path"


def test_wrong_versions_are_refused():
    fake = {"sglang": "0.5.23", "torch": "2.11.0+cu130"}.get
    [v] = check_versions(C, installed=fake)
    assert v.subject == "sglang" and "0.5.17" in v.fix
    assert check_versions(C, installed={"sglang": "0.5.17", "torch": "2.11.0+cu128"}.get) == []


def test_env_rules():
    assert check_env(C, {}) == []
    bad = {"NCCL_NVLS_ENABLE": "1", "SGLANG_SIMULATE_UNIFORM_EXPERTS": "1", "SGLANG_PLUGINS": "a,b"}
    assert {v.subject for v in check_env(C, bad)} == set(bad)
    assert check_env(C, {"NCCL_NVLS_ENABLE": "0", "SGLANG_PLUGINS": "a, true_on_policy"}) == []


def test_a_launch_without_the_plugin_entry_point_is_refused():
    """Importable but not installed (PYTHONPATH only): SGLang's scheduler processes would load no
    patches, so the plan is refused; the README's install registers the entry point."""
    from types import SimpleNamespace

    from true_on_policy.contract.policy import PLUGIN, check_plugin

    assert check_plugin() == []  # this install
    none = lambda group: []  # noqa: E731
    [v] = check_plugin(none)
    assert v.subject == "true_on_policy plugin" and "not installed" in v.found and "pip install -e ." in v.fix
    other = lambda group: [SimpleNamespace(name=PLUGIN[0], value="elsewhere.plugin:register")]  # noqa: E731
    [v] = check_plugin(other)
    assert "another install" in v.found


def test_the_plan_lists_a_missing_plugin_with_the_other_problems(tiny_cache, clean_env, monkeypatch):
    from true_on_policy.contract import launch_plan, policy

    monkeypatch.setattr(launch_plan, "check_plugin", lambda: policy.check_plugin(lambda group: []))
    with pytest.raises(PolicyError) as e:
        build_plan(C, ["--tp-size", "3"])
    assert "true_on_policy plugin" in _subjects(e.value) and len(e.value.violations) >= 2, str(e.value)


@pytest.mark.parametrize("contract, decode, prefill, bad", [
    ("qwen3_moe_true_on_policy_v1", "full", "disabled", []),
    ("qwen3_moe_true_on_policy_v1", "disabled", "disabled", []),
    ("qwen3_moe_true_on_policy_v1", "full", "breakable", ["prefill"]),
    ("qwen3_moe_true_on_policy_v1", "breakable", "tc_piecewise", ["decode", "prefill"]),
    ("qwen3_moe_true_on_policy_flat_pg_preview_v1", "full", "breakable", []),
    ("qwen3_moe_true_on_policy_flat_pg_preview_v1", "full", "disabled", []),
    ("qwen3_moe_true_on_policy_pg_preview_v1", "full", "tc_piecewise", ["prefill"]),
])
def test_the_resolved_graph_backend_of_each_phase_is_judged(contract, decode, prefill, bad):
    """What SGLang resolved (its Backend values), not the per-phase flags: one violation per phase
    outside the contract's backends; an unresolved namespace (no cuda_graph_config) is left to
    the per-phase rules."""
    from types import SimpleNamespace

    from sglang.srt.model_executor.cuda_graph_config import Backend

    from true_on_policy.contract.policy import check_graph_backends

    assert {decode, prefill} <= set(Backend.ALL)
    cfg = SimpleNamespace(decode=SimpleNamespace(backend=decode), prefill=SimpleNamespace(backend=prefill))
    got = check_graph_backends(get_contract(contract), SimpleNamespace(cuda_graph_config=cfg))
    assert [v.found.split()[1] for v in got] == bad and all(v.subject == "--cuda-graph-config" for v in got)
    assert check_graph_backends(get_contract(contract), SimpleNamespace()) == []


@pytest.mark.parametrize("field, value, ok", [
    ("json_model_override_args", "{}", True), ("json_model_override_args", "", True),
    ("json_model_override_args", '{"rms_norm_eps": 0.001}', False), ("json_model_override_args", "{not json", False),
    ("load_format", "auto", True), ("load_format", "safetensors", True), ("load_format", "pt", True),
    ("load_format", "dummy", False), ("load_format", "gguf", False), ("load_format", "bitsandbytes", False),
    ("model_impl", "auto", True), ("model_impl", "sglang", True), ("model_impl", "transformers", False),
])
def test_the_model_sglang_builds_must_be_the_checkpoint_the_trainer_loads(field, value, ok):
    from types import SimpleNamespace

    from true_on_policy.contract.policy import check_model_source

    base = {"json_model_override_args": "{}", "load_format": "auto", "model_impl": "auto"}
    got = check_model_source(SimpleNamespace(**{**base, field: value}))
    assert got == [] if ok else [v.subject for v in got] == ["--" + field.replace("_", "-")]


def test_model_source_flags_are_refused_at_launch_in_one_message(tiny_cache, clean_env):
    with pytest.raises(PolicyError) as e:
        build_plan(C, ["--json-model-override-args", '{"num_experts_per_tok": 1}', "--load-format", "dummy",
                       "--model-impl", "transformers"])
    assert {"--json-model-override-args", "--load-format", "--model-impl"} <= _subjects(e.value)
