"""``python -m launch.server``: --dry-run plans without a GPU (and prints no key); bad input fails before GPU
work."""

import json
import os
import subprocess
import sys

import pytest
from helpers import ROOT, run_py

# the default contract (qwen3_moe_true_on_policy_flat_v1) and its fingerprint, pinned: a change must be deliberate
DEFAULT, FP = "qwen3_moe_true_on_policy_flat_v1", "bf0f9c647a8e0e370ae4089ed2a494a8fc564ef17a2d799bb8410c17337b810a"


def _launch(*args, env_extra=None):
    e = {k: v for k, v in os.environ.items() if not k.startswith(("SGLANG_TRUE_ON_POLICY", "NCCL_"))}
    e.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "launch.server", *args], capture_output=True, text=True,
                          cwd=ROOT, env=e, timeout=300)


@pytest.fixture
def restored_env():
    """The process environment as it was before the test: SGLang's resolution writes os.environ
    (NCCL_ALGO at TP > 1) when it accepts a plan."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture
def cli(tiny_cache, clean_env, restored_env, capsys):
    """``python -m launch.server ARGS`` as ``launch.server.main(ARGS)`` in this process, which imported
    SGLang once (a fresh process spends most of a dry run importing it again): the result reads like
    ``_launch``'s finished process, from an environment without overlay or NCCL settings plus
    ``env_extra``. ``_launch`` keeps the tests of the module run as a command (quiet, exit codes)."""
    for name in [n for n in os.environ if n.startswith(("SGLANG_TRUE_ON_POLICY", "NCCL_"))]:
        clean_env.delenv(name)

    def run(*args, env_extra=None):
        from launch.server import main

        capsys.readouterr()
        with pytest.MonkeyPatch.context() as mp:
            for name, value in (env_extra or {}).items():
                mp.setenv(name, value)
            rc = main(list(args))  # an exception here fails the test: no traceback passes for a refusal
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(args, rc, out, err)

    return run


def test_dry_run_accepts_a_valid_plan(tiny_cache):
    r = _launch("--true-on-policy", "--dry-run", "--tp-size", "1", "--random-seed", "3")
    assert r.returncode == 0, r.stderr[-3000:]
    plan = json.loads(r.stdout)
    assert plan["fingerprint"] == FP and plan["contract"] == DEFAULT
    assert plan["embedded_model"] is True
    assert plan["resolved"]["attention_backend"] == "triton" and plan["resolved"]["tp_size"] == 1
    assert plan["env"]["NCCL_NVLS_ENABLE"] == "0"
    assert "--disable-custom-all-reduce" in plan["argv"]
    from launch.server import PLATFORM_NOISE

    assert not [n for n in PLATFORM_NOISE if n in r.stderr], r.stderr[-3000:]  # a CPU host's warnings, filtered


def test_dry_run_rejects_a_bad_plan_listing_everything(cli):
    r = cli("--true-on-policy", "--dry-run", "--attention-backend", "fa3", "--enable-dp-attention",
                "--quantization", "fp8", env_extra={"NCCL_NVLS_ENABLE": "1"})
    assert r.returncode == 2
    err = r.stderr
    for subject in ("NCCL_NVLS_ENABLE", "--attention-backend"):
        assert subject in err, err[-3000:]
    assert "Traceback" not in err


PREVIEW = ("--true-on-policy", "--true-on-policy-contract", "qwen3_moe_true_on_policy_tp_preview_v1", "--dry-run")


def test_dry_run_accepts_pp2_and_tp2_pp2_in_the_preview(cli):
    from true_on_policy.contract import get_contract

    r = cli(*PREVIEW, "--pp-size", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    plan = json.loads(r.stdout)
    assert plan["fingerprint"] == get_contract("qwen3_moe_true_on_policy_tp_preview_v1").fingerprint
    assert plan["resolved"]["pp_size"] == 2
    r = cli(*PREVIEW, "--pp-size", "2", "--tp-size", "2", env_extra={"SGLANG_PP_LAYER_PARTITION": "1,1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert (json.loads(r.stdout)["resolved"]["tp_size"], json.loads(r.stdout)["resolved"]["pp_size"]) == (2, 2)


def test_dry_run_refuses_pp_layouts_the_model_cannot_split(cli):
    """The embedded model has 2 layers: PP3, a partition of zeros or of the wrong sum, all in one message."""
    r = cli(*PREVIEW, "--pp-size", "3", env_extra={"SGLANG_PP_LAYER_PARTITION": "2,0,0"})
    assert r.returncode == 2 and "Traceback" not in r.stderr
    err = r.stderr[r.stderr.index("error: true-on-policy contract"):]
    assert "2 violation(s)" in err and "(at most 2 stages)" in err, err
    assert "--pp-size: 3 stages for 2 decoder layers" in err
    assert "gives stage(s) [1, 2] no layers" in err and "SGLANG_PP_LAYER_PARTITION" in err
    assert "--disable-overlap-schedule" not in err  # SGLang resolves it on at pp > 1; not blamed on unresolved args
    r = cli(*PREVIEW, "--pp-size", "2", env_extra={"SGLANG_PP_LAYER_PARTITION": "2,1"})
    assert r.returncode == 2 and "sums to 3, the model has 2 decoder layers" in r.stderr
    r = cli("--true-on-policy", "--dry-run", "--pp-size", "2")  # the default contract: PP is the preview's
    assert r.returncode == 2 and "--pp-size: 2" in r.stderr
    assert ("--true-on-policy-contract qwen3_moe_true_on_policy_tp_preview_v1, which allows --pp-size 2"
            in r.stderr), r.stderr[-2000:]  # the refusal names the contract that routes PP


def test_unknown_contract(tiny_cache):
    r = _launch("--true-on-policy", "--true-on-policy-contract", "nope_v9", "--dry-run")
    from true_on_policy.contract import known_contracts

    assert r.returncode == 2 and f"known contracts: {', '.join(known_contracts())}" in r.stderr
    assert len(known_contracts()) == 6 and "qwen3_moe_true_on_policy_w2_preview_v1" in r.stderr


def test_dry_run_needs_true_on_policy():
    r = _launch("--dry-run")
    assert r.returncode == 2 and "--true-on-policy" in r.stderr


def test_no_cuda_is_one_clear_line(cli):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    r = cli("--true-on-policy")
    assert r.returncode == 1
    assert "needs an NVIDIA GPU" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("form", ["space", "equals"])
def test_dry_run_never_prints_a_key(tiny_cache, clean_env, capsys, form):
    from launch.server import main

    keys = (["--api-key", "SECRET123", "--admin-api-key", "ADMIN456"] if form == "space"
            else ["--api-key=SECRET123", "--admin-api-key=ADMIN456"])
    assert main(["--true-on-policy", "--dry-run", "--tp-size", "1", *keys]) == 0
    out, err = capsys.readouterr()
    assert "SECRET123" not in out + err and "ADMIN456" not in out + err
    argv = json.loads(out)["argv"]
    if form == "space":
        i, j = argv.index("--api-key"), argv.index("--admin-api-key")
        assert argv[i + 1] == argv[j + 1] == "<redacted>"
    else:
        assert "--api-key=<redacted>" in argv and "--admin-api-key=<redacted>" in argv
    assert argv[argv.index("--tp-size") + 1] == "1"  # the rest stays readable


def test_own_flags_are_stripped():
    from launch.server import split_own_flags

    own, rest = split_own_flags(["--true-on-policy", "--true-on-policy-keep-manifests", "--port", "1",
                                 "--true-on-policy-contract=x_v1", "--dry-run"])
    assert own == {"true_on_policy": True, "contract": "x_v1", "dry_run": True, "keep_manifests": True}
    assert rest == ["--port", "1"]
    assert split_own_flags(["--true-on-policy"])[0]["keep_manifests"] is False


def test_argparse_error_does_not_echo_a_secret(tiny_cache, clean_env, capsys):
    from launch.server import main

    with pytest.raises(SystemExit):  # an unknown flag: argparse quotes the rest of the command line
        main(["--true-on-policy", "--dry-run", "--admin-key", "SECRET123"])
    err = capsys.readouterr().err
    assert "unrecognized arguments" in err and "SECRET123" not in err and "<redacted>" in err


OUR_FLAGS = ("--true-on-policy", "--true-on-policy-contract", "--dry-run", "--true-on-policy-keep-manifests")


def test_help_lists_our_flags_then_sglangs_quietly_and_fast_once_cached(tmp_path):
    """The first --help renders SGLang's parser (and prints none of a CPU host's platform warnings);
    a second one reads the same text from the cache folder and imports neither SGLang nor torch.
    --model-path is optional in the usage line: under the overlay the embedded model stands in."""
    cache = {"TRUE_ON_POLICY_CACHE": str(tmp_path)}
    r = _launch("--help", env_extra=cache)
    assert r.returncode == 0 and r.stderr == "", r.stderr[-3000:]
    ours, _, sglang = r.stdout.partition("usage: python -m launch.server")
    for flag in OUR_FLAGS:
        assert f"  {flag} " in ours, ours
    assert "--model-path" in sglang and "--tp-size" in sglang  # SGLang's own help follows
    assert sglang.startswith(" [-h] [--model-path MODEL_PATH]"), sglang[:200]
    assert "optional; omitted, the overlay serves its embedded" in " ".join(sglang.split())
    assert [p.parent.name for p in tmp_path.glob("*/*.txt")] == ["sglang-help"]
    code = ("import sys; from launch.server import main; rc = main(['--help']); "
            "print('IMPORTED', sorted(m for m in ('sglang', 'torch') if m in sys.modules), file=sys.stderr); "
            "sys.exit(rc)")
    again = run_py(code, env_extra=cache)
    assert again.returncode == 0 and again.stdout == r.stdout, again.stderr[-3000:]
    assert again.stderr == "IMPORTED []\n", again.stderr[-3000:]


def test_help_with_true_on_policy_builds_nothing(clean_env, tmp_path, capsys):
    from launch.server import main

    clean_env.setenv("TRUE_ON_POLICY_CACHE", str(tmp_path))  # the embedded checkpoint would be built here
    assert main(["--true-on-policy", "--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"  {flag} " in out for flag in OUR_FLAGS) and "--model-path" in out
    assert [p.name for p in tmp_path.iterdir()] == ["sglang-help"]  # SGLang's help text only, no checkpoint


@pytest.mark.parametrize("argv", [["--true-on-policy-contract"], ["--true-on-policy-contract", "--dry-run"],
                                  ["--true-on-policy-contract="]])
def test_contract_flag_without_a_name_is_a_usage_error(capsys, argv):
    from launch.server import main

    assert main(["--true-on-policy", *argv]) == 2
    from true_on_policy.contract import known_contracts

    assert capsys.readouterr().err == ("error: --true-on-policy-contract needs a contract name (known: "
                                       f"{', '.join(known_contracts())})\n")


def test_routed_experts_and_tokenizer_workers_refused_at_launch(cli):
    """The contract's router bypasses SGLang's routed-expert capture, and per-sample seeds live in
    the one tokenizer process: both are refused in one message before any GPU work."""
    r = cli("--true-on-policy", "--dry-run", "--enable-return-routed-experts", "--tokenizer-worker-num", "2")
    assert r.returncode == 2, r.stdout[-2000:]
    assert "--enable-return-routed-experts" in r.stderr and "--tokenizer-worker-num" in r.stderr
    assert "2 violation(s)" in r.stderr, r.stderr[-2000:]


LAYOUTS_4_8 = [["--tp-size", "4"], ["--tp-size", "8"], ["--tp-size", "4", "--ep-size", "4"],
               ["--tp-size", "8", "--ep-size", "8"], ["--tp-size", "2", "--pp-size", "2"]]
GEOMETRIES_30B_235B = {
    "Qwen3-30B-A3B": dict(hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                          moe_intermediate_size=768),
    "Qwen3-235B-A22B": dict(hidden_size=4096, num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4,
                            moe_intermediate_size=1536)}


def test_dry_run_plans_of_the_four_and_eight_gpu_layouts(tmp_path, clean_env, restored_env):
    """Issue 18's layouts (TP 4/8, TP x EP 4/8, TP 2 x PP 2) on the 30B-A3B and 235B-A22B geometries
    (config and tokenizer, no weights): the preview contract plans each, resolved as asked, NVLink
    multicast off. The runs themselves need the 4- and 8-GPU kinds."""
    from transformers import Qwen3MoeConfig

    from true_on_policy.contract import get_contract
    from true_on_policy.contract.launch_plan import build_plan
    from true_on_policy.tiny_model import build_tokenizer

    for name in [n for n in os.environ if n.startswith(("SGLANG_TRUE_ON_POLICY", "NCCL_"))]:
        clean_env.delenv(name)
    planned = 0
    for name, g in GEOMETRIES_30B_235B.items():
        folder = str(tmp_path / name)
        Qwen3MoeConfig(vocab_size=151936, intermediate_size=6144, head_dim=128, num_experts=128, num_experts_per_tok=8,
                       max_position_embeddings=40960, tie_word_embeddings=False, architectures=["Qwen3MoeForCausalLM"],
                       **g).save_pretrained(folder)
        build_tokenizer(folder)  # a checkpoint folder holds its tokenizer
        for lay in LAYOUTS_4_8:
            plan = build_plan(get_contract("qwen3_moe_true_on_policy_tp_preview_v1"), ["--model-path", folder, *lay])
            sa = plan.server_args
            asked = dict(zip(lay[::2], map(int, lay[1::2]), strict=True))
            assert [sa.tp_size, sa.ep_size, sa.pp_size] == [
                asked.get("--tp-size", 1), asked.get("--ep-size", 1), asked.get("--pp-size", 1)], (name, lay)
            assert plan.env.get("NCCL_NVLS_ENABLE") == "0", (name, lay)
            planned += 1
    assert planned == 2 * len(LAYOUTS_4_8)


def test_the_prefill_graph_preview_leaves_prefill_graphs_to_sglang_and_judges_what_they_resolve_to(cli):
    """Under the preview, --cuda-graph-backend-prefill is not forced (SGLang's CUDA default is
    breakable; this CPU host resolves its own default, which deterministic mode turns off); a
    backend the contract does not allow is refused whether it comes from the per-phase flag or
    from --cuda-graph-config JSON, which wins over it; v1 still forces prefill graphs off."""
    from true_on_policy.contract import get_contract

    name = "qwen3_moe_true_on_policy_flat_pg_preview_v1"
    r = cli("--true-on-policy", "--true-on-policy-contract", name, "--dry-run")
    assert r.returncode == 0, r.stderr[-3000:]
    plan = json.loads(r.stdout)
    assert plan["contract"] == name and plan["fingerprint"] == get_contract(name).fingerprint
    assert plan["resolved"]["cuda_graph_backend_prefill"] is None and "--cuda-graph-backend-prefill" not in plan["argv"]
    assert plan["cuda_graph_backends"]["prefill"] in ("breakable", "disabled")
    ok = cli("--true-on-policy", "--true-on-policy-contract", name, "--dry-run", "--cuda-graph-backend-prefill",
                 "breakable")
    assert ok.returncode == 0 and json.loads(ok.stdout)["cuda_graph_backends"]["prefill"] == "breakable", ok.stderr
    v1 = json.loads(cli("--true-on-policy", "--dry-run").stdout)
    assert v1["resolved"]["cuda_graph_backend_prefill"] == "disabled" and v1["cuda_graph_backends"]["prefill"] == "disabled"
    for contract in (name, "qwen3_moe_true_on_policy_v1"):
        r = cli("--true-on-policy", "--true-on-policy-contract", contract, "--dry-run", "--cuda-graph-config",
                    '{"prefill": {"backend": "tc_piecewise"}, "decode": {"backend": "breakable"}}')
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
        assert "prefill CUDA graphs resolved to 'tc_piecewise'" in r.stderr
        assert "decode CUDA graphs resolved to 'breakable'" in r.stderr
    r = cli("--true-on-policy", "--true-on-policy-contract", name, "--dry-run", "--cuda-graph-backend-prefill",
                "tc_piecewise")
    assert r.returncode == 2 and "--cuda-graph-backend-prefill" in r.stderr and "Traceback" not in r.stderr


def test_sglangs_own_refusal_is_named_in_the_same_list_as_ours(cli):
    """--dp-size 2 --enable-dp-attention fails SGLang's bare ``assert self.tp_size % self.dp_size == 0``
    (under ``if enable_dp_attention``): the problem names the three flags with the values SGLang saw,
    listed with the contract's own findings on the same command line (fp8 KV cache, both DP flags)."""
    r = cli("--true-on-policy", "--dry-run", "--dp-size", "2", "--enable-dp-attention", "--kv-cache-dtype", "fp8_e4m3")
    err = r.stderr
    assert r.returncode == 2, err[-3000:]
    lines = [line[4:] for line in err.splitlines() if line.startswith("  - ")]
    assert "4 violation(s)" in err and len(lines) == 4, err[-3000:]
    assert {line.split(":")[0] for line in lines} == {
        "--kv-cache-dtype", "--dp-size", "--enable-dp-attention", "--enable-dp-attention / --tp-size / --dp-size"}
    [sglang] = [line for line in lines if line.startswith("--enable-dp-attention / ")]
    assert ("SGLang refuses them together: with --enable-dp-attention True, its check `tp_size % dp_size == 0` "
            "fails (--tp-size 1, --dp-size 2)") in sglang, sglang
    assert "refused the arguments ()" not in err


def _checkpoint_without_tokenizer(tmp_path) -> str:
    from true_on_policy import tiny_model

    embedded = tiny_model.ensure("embedded")
    folder = tmp_path / "no-tokenizer"
    folder.mkdir()
    for f in os.listdir(embedded):
        if f == "config.json" or f.endswith(".safetensors"):
            os.symlink(os.path.join(embedded, f), folder / f)
    return str(folder)


def test_checkpoint_without_tokenizer_files_is_refused_unless_skip_tokenizer_init(cli, tmp_path):
    """Weights and config without a tokenizer would load and then fail: refused before any GPU work,
    in the same list as the other problems; --skip-tokenizer-init (token ids in and out) or a
    --tokenizer-path holding the files is accepted; a --tokenizer-path that is not a folder is refused."""
    from true_on_policy import tiny_model

    bare = _checkpoint_without_tokenizer(tmp_path)
    dry = ("--true-on-policy", "--dry-run", "--model-path", bare)
    r = cli(*dry, "--attention-backend", "fa3")
    assert r.returncode == 2 and "2 violation(s)" in r.stderr, r.stderr[-3000:]
    assert f"--model-path: {bare!r} has no tokenizer files (tokenizer.json or vocab.json + merges.txt" in r.stderr
    assert "--skip-tokenizer-init" in r.stderr and "--attention-backend" in r.stderr
    r = cli(*dry, "--skip-tokenizer-init")
    assert r.returncode == 0 and json.loads(r.stdout)["model_path"] == bare, r.stderr[-3000:]
    r = cli(*dry, "--tokenizer-path", tiny_model.ensure("embedded"))
    assert r.returncode == 0, r.stderr[-3000:]
    r = cli(*dry, "--tokenizer-path", str(tmp_path / "absent"))
    assert r.returncode == 2 and "--tokenizer-path: " in r.stderr and "is not a local folder" in r.stderr, r.stderr


def test_help_prints_when_the_cache_cannot_be_written(tmp_path, monkeypatch):
    """The cache is an optimisation: where --help cannot write it (here the cache path is a file, which
    stops root too), the whole help is still printed."""
    from launch import help_text

    monkeypatch.setattr(help_text, "render_sglang_help", lambda: "usage: rendered\n")
    (tmp_path / "cache").write_text("not a folder")
    assert help_text.sglang_help(tmp_path / "cache") == "usage: rendered\n"
    assert (tmp_path / "cache").read_text() == "not a folder"
