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


# Stands in for SGLang's ServerArgs under resolution (its checks read ``self.<field>``); loaded from a
# file of its own, as SGLang's is, so that pytest's assertion rewriting leaves its asserts bare.
ARGS_SOURCE = """
class Args:
    def __init__(self, **fields):
        self.__dict__.update(fields)

    def resolve(self):
        if self.enable_dp_attention:
            if self.dp_size > 1:
                assert self.tp_size % self.dp_size == 0

    def resolve_with_message(self):
        assert self.ep_size <= self.tp_size, "ep_size must not exceed tp_size"
"""


def _args_class(tmp_path):
    import importlib.util

    (tmp_path / "resolving_args.py").write_text(ARGS_SOURCE)
    spec = importlib.util.spec_from_file_location("resolving_args", tmp_path / "resolving_args.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Args


def _raised(call) -> BaseException:
    try:
        call()
    except Exception as e:  # noqa: BLE001 - the refusal under test
        return e
    raise AssertionError("no refusal")


def test_a_bare_sglang_assert_names_the_flags_it_reads_and_the_ifs_around_it(tmp_path):
    """The failed condition is read from the source, the enclosing ``if`` conditions too; every
    argument they read is named with the value the check saw (``self``), not the one given."""
    from argparse import Namespace

    from true_on_policy.contract.sglang_refusal import sglang_refusal

    Args = _args_class(tmp_path)
    given = Namespace(tp_size=1, dp_size=2, ep_size=1, enable_dp_attention=True)
    seen = Args(tp_size=3, dp_size=2, ep_size=1, enable_dp_attention=True)  # resolution changed tp_size
    v = sglang_refusal(_raised(seen.resolve), given)
    assert v.subject == "--enable-dp-attention / --dp-size / --tp-size", v
    assert v.found == ("SGLang refuses them together: with --enable-dp-attention True, --dp-size 2, its check "
                       "`tp_size % dp_size == 0` fails (--tp-size 3, --dp-size 2)"), v.found
    assert "`tp_size % dp_size == 0` holds" in v.fix
    v = sglang_refusal(_raised(Args(ep_size=4, tp_size=2).resolve_with_message), given)
    assert v.subject == "--ep-size / --tp-size" and v.found.endswith("(--ep-size 4, --tp-size 2): ep_size must not "
                                                                     "exceed tp_size"), v


def test_any_other_sglang_refusal_names_the_flags_its_message_mentions():
    from argparse import Namespace

    from true_on_policy.contract.sglang_refusal import sglang_refusal

    given = Namespace(tp_size=1, dp_size=2, speculative_algorithm=None, port=1)
    v = sglang_refusal(ValueError("--dp-size 2 needs\n speculative_algorithm unset (port is fine)"), given)
    assert v.subject == "--dp-size / --speculative-algorithm", v  # "port" alone is a word, not a field name
    assert v.found == "SGLang refused the arguments (ValueError: --dp-size 2 needs speculative_algorithm unset " \
                      "(port is fine))"
    v = sglang_refusal(RuntimeError(), given)
    assert v.subject == "sglang" and "no message" in v.found


def test_sglangs_refusal_comes_with_every_rule_of_ours_the_arguments_break(tiny_cache, clean_env):
    """In process, as the engine plans: SGLang's resolution raises (DP attention at TP 1), and the
    one PolicyError also lists the contract's own refusals of the same arguments."""
    with pytest.raises(PolicyError) as e:
        build_plan_from_kwargs(C, {"dp_size": 2, "enable_dp_attention": True, "kv_cache_dtype": "fp8_e4m3"})
    assert _subjects(e.value) == {"--kv-cache-dtype", "--dp-size", "--enable-dp-attention",
                                  "--enable-dp-attention / --tp-size / --dp-size"}, str(e.value)


def test_a_refused_value_names_the_contracts_that_allow_it():
    """v1 refuses --pp-size 2 and names the TP preview, which routes PP; a rule whose alternative
    already names the contract does not name it twice; a value no contract allows names none."""
    from argparse import Namespace

    from true_on_policy.contract.policy import check_args

    def fix(subject, **fields):
        args = Namespace(**{**{r.dest: r.allowed[0] for r in C.args}, "model_path": None, **fields})
        [v] = [v for v in check_args(C, args) if v.subject == subject]
        return v.fix

    preview = "qwen3_moe_true_on_policy_tp_preview_v1"
    assert fix("--pp-size", pp_size=2).endswith(f"; or --true-on-policy-contract {preview}, which allows --pp-size 2 "
                                                "(the trainer must load the same contract)")
    assert fix("--tp-size", tp_size=2).count(preview) == 1  # v1's own alternative names it
    assert "--true-on-policy-contract" not in fix("--pp-size", pp_size=9)  # past every contract's PP degrees


def test_the_tokenizer_files_are_checked_where_sglang_will_load_them(tmp_path):
    from argparse import Namespace

    from true_on_policy.contract.policy import check_tokenizer

    model, tok = tmp_path / "model", tmp_path / "tok"
    model.mkdir(), tok.mkdir()
    (model / "config.json").write_text("{}")
    args = lambda **kw: Namespace(**{"model_path": str(model), "tokenizer_path": None,  # noqa: E731
                                     "skip_tokenizer_init": False, **kw})
    [v] = check_tokenizer(args())
    assert v.subject == "--model-path" and "has no tokenizer files" in v.found and "--skip-tokenizer-init" in v.fix
    assert check_tokenizer(args(skip_tokenizer_init=True)) == []
    assert check_tokenizer(args(tokenizer_path=str(model))) == [v]  # SGLang's resolution sets it to the model's
    [v] = check_tokenizer(args(tokenizer_path=str(tok)))
    assert v.subject == "--tokenizer-path" and str(tok) in v.found
    for files in (["tokenizer.json"], ["vocab.json", "merges.txt"], ["tokenizer.model"]):
        for f in files:
            (tok / f).write_text("{}")
        assert check_tokenizer(args(tokenizer_path=str(tok))) == [], files
        for f in files:
            (tok / f).unlink()
    (tok / "vocab.json").write_text("{}")  # half of a BPE pair
    assert len(check_tokenizer(args(tokenizer_path=str(tok)))) == 1
    assert check_tokenizer(args(model_path=str(tmp_path / "absent"))) == []  # the model check reports the folder
    [v] = check_tokenizer(args(tokenizer_path="Qwen/Qwen3-30B-A3B"))
    assert "is not a local folder" in v.found
