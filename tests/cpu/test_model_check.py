"""One model check: the dry-run, the engine's planning and ``patch_hf_model`` accept or refuse
every config variant alike, with the same problem text; checkpoint paths fail with what to pass;
the published Qwen3-MoE geometries are accepted, and sharded as SGLang shards them."""

import json

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from true_on_policy.contract import get_contract, model_check
from true_on_policy.contract.launch_plan import build_plan_from_kwargs
from true_on_policy.contract.policy import PolicyError, check_model
from true_on_policy.trainer import TrainerPatchError, patch_hf_model

C = get_contract("qwen3_moe_true_on_policy_v1")

# A tiny checkpoint config as config.json holds it (built on CPU in well under a second).
BASE = dict(
    architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=512, hidden_size=128,
    intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=64, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
    max_position_embeddings=4096, rope_theta=1_000_000.0, rms_norm_eps=1e-6, decoder_sparse_step=1,
    mlp_only_layers=[], tie_word_embeddings=False, torch_dtype="bfloat16",
)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 1024}
# (name, overrides, subjects of the expected problems; empty = accepted)
VARIANTS = [
    ("plain", {}, set()),
    ("yarn", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}},
     set()),
    ("hq/hkv=3", {"num_attention_heads": 6, "num_key_value_heads": 2}, set()),
    ("vocab 3001", {"vocab_size": 3001}, set()),
    ("head_dim 128", {"head_dim": 128}, set()),
    ("attention_bias", {"attention_bias": True}, {"attention_bias"}),
    ("mlp_only_layers", {"mlp_only_layers": [1]}, {"mlp_only_layers"}),
    ("head_dim 96", {"head_dim": 96}, {"head_dim"}),
    ("rope llama3", {"rope_scaling": LLAMA3}, {"rope_scaling"}),
    ("sliding window", {"use_sliding_window": True, "sliding_window": 256}, {"use_sliding_window"}),
    ("everything at once", {"attention_bias": True, "mlp_only_layers": [0], "head_dim": 96, "rope_scaling": LLAMA3},
     {"attention_bias", "mlp_only_layers", "head_dim", "rope_scaling"}),
]


def _checkpoint(tmp_path, cfg: dict) -> str:
    """A checkpoint folder as the launcher reads it: config.json and the tokenizer's files (no weights)."""
    from true_on_policy import tiny_model

    (tmp_path / "config.json").write_text(json.dumps(cfg))
    tiny_model.build_tokenizer(tmp_path)
    return str(tmp_path)


def _dry_run(capsys, path) -> list[str]:
    from launch.server import main

    rc = main(["--true-on-policy", "--dry-run", "--model-path", path])
    out, err = capsys.readouterr()
    if rc == 0:
        assert json.loads(out)["model_path"] == path
        return []
    assert rc == 2 and err.startswith("error: "), err[-2000:]
    return [line[4:] for line in err.splitlines() if line.startswith("  - ")]


def _engine_plan(path) -> list[str]:
    try:
        build_plan_from_kwargs(C, {"model_path": path})
    except PolicyError as e:
        return [str(v) for v in e.violations]
    return []


def _trainer(cfg: dict) -> list[str]:
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig.from_dict(cfg)).to(torch.bfloat16)
    try:
        patch_hf_model(model)
    except TrainerPatchError as e:
        return [line[4:] for line in str(e).splitlines() if line.startswith("  - ")]
    return []


@pytest.mark.parametrize("name, overrides, subjects", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_dry_run_engine_and_trainer_agree(tiny_cache, clean_env, capsys, tmp_path, name, overrides, subjects):
    cfg = dict(BASE, **overrides)
    path = _checkpoint(tmp_path, cfg)
    dry, engine, trainer = _dry_run(capsys, path), _engine_plan(path), _trainer(cfg)
    assert dry == engine == trainer, (dry, engine, trainer)
    assert {p.split(":")[0] for p in trainer} == subjects, trainer


@pytest.mark.parametrize("make, expect", [
    (lambda d: str(d / "nope"), "does not exist; it is not a local folder"),
    (lambda d: "Qwen/Qwen3-30B-A3B", "is not a local folder (it looks like a Hugging Face hub id; nothing is ever "
                                     "downloaded)"),
    (lambda d: str(d), "is an empty folder, not a checkpoint folder"),
    (lambda d: (d / "weights.bin").write_text("x") and str(d), "is a folder without config.json"),
    (lambda d: (d / "weights.bin").write_text("x") and str(d / "weights.bin"), "is a file, not a local folder"),
    (lambda d: (d / "config.json").write_text("{") and str(d), "cannot be read as JSON"),
    (lambda d: (d / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}') and str(d),
     "LlamaForCausalLM is not supported"),
])
def test_model_path_says_what_is_wrong(tmp_path, make, expect):
    [v] = check_model(C, make(tmp_path))
    assert expect in v.found, v
    assert "checkpoint" in v.fix and "Repo id" not in v.found and "internet" not in v.found


def test_config_json_given_as_path_points_to_its_folder(tmp_path):
    path = _checkpoint(tmp_path, BASE)
    [v] = check_model(C, path + "/config.json")
    assert v.fix == f"pass its folder {path!r}"


def test_dry_run_of_a_hub_id_downloads_nothing(clean_env, capsys):
    [line] = _dry_run(capsys, "Qwen/Qwen3-30B-A3B")
    assert line.startswith("--model-path: 'Qwen/Qwen3-30B-A3B' is not a local folder")
    assert "hf download Qwen/Qwen3-30B-A3B --local-dir DIR" in line


# Published config.json geometries (see the README's Checkpoints table).
PUBLIC = {
    "Qwen3-30B-A3B": dict(hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                          num_experts=128, moe_intermediate_size=768, max_position_embeddings=40960),
    "Qwen3-235B-A22B": dict(hidden_size=4096, num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4,
                            num_experts=128, moe_intermediate_size=1536, max_position_embeddings=40960),
    "Qwen3-Coder-480B-A35B-Instruct": dict(hidden_size=6144, num_hidden_layers=62, num_attention_heads=96,
                                           num_key_value_heads=8, num_experts=160, moe_intermediate_size=2560,
                                           max_position_embeddings=262144, rope_theta=10_000_000.0),
}


@pytest.mark.parametrize("name", sorted(PUBLIC))
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_public_geometries_accepted_at_every_tp(name, tp):
    cfg = Qwen3MoeConfig.from_dict(dict(BASE, head_dim=128, num_experts_per_tok=8, vocab_size=151936, **PUBLIC[name]))
    assert model_check.check_config(cfg, ["Qwen3MoeForCausalLM"], tp_size=tp) == []
    assert model_check.check_config(cfg, ["Qwen3MoeForCausalLM"], tp_size=tp, ep_size=tp) == []


@pytest.mark.parametrize("hq, hkv, tp, problems", [
    (6, 2, 2, 0),   # group 3, KV heads split
    (6, 2, 4, 1),   # query heads do not split over 4
    (12, 3, 2, 1),  # 3 KV heads over 2 ranks: neither split nor replicated
    (12, 3, 6, 0),  # KV heads replicated twice
    (64, 4, 8, 0),  # Qwen3-235B-A22B at TP 8: each KV head on two ranks
    (16, 8, 16, 0),
    (96, 8, 3, 1),
])
def test_sharding_follows_sglang(hq, hkv, tp, problems):
    cfg = Qwen3MoeConfig.from_dict(dict(BASE, num_attention_heads=hq, num_key_value_heads=hkv, num_experts=128,
                                        moe_intermediate_size=768))  # experts shard at every TP here
    got = model_check.check_sharding(cfg, tp)
    assert len(got) == problems, got
    assert all(p.subject == "--tp-size" for p in got)


def test_experts_must_shard_over_ep_and_moe_tp(tmp_path):
    cfg = Qwen3MoeConfig.from_dict(dict(BASE, num_attention_heads=8, num_key_value_heads=8, num_experts=6,
                                        moe_intermediate_size=72))
    assert {p.subject for p in model_check.check_sharding(cfg, 4, 4)} == {"--ep-size"}  # 6 experts over EP 4
    [p] = model_check.check_sharding(cfg, 8, 1)  # MoE-TP 8 > 6 experts, and 72 % 8 == 0
    assert "exceeds the 6 experts" in p.found
    cfg = Qwen3MoeConfig.from_dict(dict(BASE, moe_intermediate_size=36))
    assert {p.subject for p in model_check.check_config(cfg, ["Qwen3MoeForCausalLM"], tp_size=8)} == {
        "moe_intermediate_size", "--tp-size"}  # not a multiple of the tree's 8 segments, nor of MoE-TP 8


def test_tp_sharding_problems_reach_the_engine_plan(tiny_cache, clean_env, tmp_path):
    path = _checkpoint(tmp_path, dict(BASE, num_attention_heads=6, num_key_value_heads=2))
    preview = get_contract("qwen3_moe_true_on_policy_tp_preview_v1")
    with pytest.raises(PolicyError) as e:
        build_plan_from_kwargs(preview, {"model_path": path, "tp_size": 4})
    assert [v.subject for v in e.value.violations] == ["--tp-size"]
    assert "does not divide the 6 query heads" in str(e.value)
    assert build_plan_from_kwargs(preview, {"model_path": path, "tp_size": 2}).server_args.tp_size == 2


@pytest.mark.parametrize("geometry", sorted(__import__("true_on_policy.tiny_model",
                                                       fromlist=["GEOMETRIES"]).GEOMETRIES))
def test_every_built_geometry_passes_the_model_check(geometry):
    """The checkpoints the GPU runs build (tiny_model) are accepted at TP 1, and at TP 2 (preview)
    where their heads shard; a refusal would only surface on the GPU host."""
    from true_on_policy.tiny_model import GEOMETRIES

    spec = {k: v for k, v in GEOMETRIES[geometry].items() if k != "seed"}
    cfg = Qwen3MoeConfig(**spec, decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False)
    assert model_check.check_config(cfg, ["Qwen3MoeForCausalLM"]) == []
    if geometry in ("a22b2", "a35b2", "a3b6", "a3b48", "embedded"):  # the TP2 runs of regenerate_evidence.sh
        assert model_check.check_config(cfg, ["Qwen3MoeForCausalLM"], tp_size=2) == []
