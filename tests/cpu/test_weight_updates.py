"""Weight updates are judged whole before anything is copied, against the running checkpoint read from
safetensors headers (``true_on_policy.contract.checkpoint``, ``patches/weight_updates.py``), on real
safetensors files made here. The GPU tier sends the same updates to a running server
(``true_on_policy.harness.robustness``)."""

import asyncio
import json
import sys
import types

import pytest
import torch
from safetensors.torch import save_file
from true_on_policy.patches import weight_updates as wu

from true_on_policy.contract import checkpoint

CFG = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 8,
       "moe_intermediate_size": 4, "num_hidden_layers": 1, "vocab_size": 16}


def _ckpt(folder, cfg=CFG, inter=4, dtype=torch.bfloat16, extra=None, shards=1):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    t = {"model.embed_tokens.weight": torch.zeros(16, 8, dtype=dtype),
         "model.layers.0.mlp.experts.0.down_proj.weight": torch.zeros(8, inter, dtype=dtype),
         "model.layers.0.mlp.experts.0.gate_proj.weight": torch.zeros(inter, 8, dtype=dtype),
         **(extra or {})}
    if shards == 1:
        save_file(t, str(folder / "model.safetensors"))
    else:
        names = sorted(t)
        weight_map = {}
        for i in range(shards):
            part = {n: t[n] for n in names[i::shards]}
            save_file(part, str(folder / f"model-{i}.safetensors"))
            weight_map.update({n: f"model-{i}.safetensors" for n in part})
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return folder


def test_a_checkpoint_of_the_same_model_fits(tmp_path):
    cfg, table, problems = checkpoint.read_table(_ckpt(tmp_path / "a"))
    assert problems == [] and table["model.layers.0.mlp.experts.0.down_proj.weight"] == ((8, 4), "bfloat16")
    new = checkpoint.read_table(_ckpt(tmp_path / "b", shards=2))
    assert new[2] == [] and checkpoint.update_problems((cfg, table), new[:2]) == []


def test_another_moe_intermediate_size_is_refused_naming_config_and_every_shape(tmp_path):
    cur = checkpoint.read_table(_ckpt(tmp_path / "a"))[:2]
    cfg, table, problems = checkpoint.read_table(_ckpt(tmp_path / "b", {**CFG, "moe_intermediate_size": 6}, inter=6))
    found = checkpoint.update_problems(cur, (cfg, table))
    assert problems == [] and len(found) == 3, found
    assert "moe_intermediate_size" in found[0]
    assert any("down_proj" in f and "(8, 6)" in f for f in found) and any("gate_proj" in f for f in found)


def test_missing_path_unreadable_and_truncated_files_are_problems(tmp_path):
    assert "no such checkpoint folder" in checkpoint.read_table(tmp_path / "nope")[2][0]
    folder = _ckpt(tmp_path / "t")
    f = folder / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-10])
    assert "truncated" in checkpoint.read_table(folder)[2][0]
    f.write_bytes(b"\x00\x01")
    assert "unreadable" in checkpoint.read_table(folder)[2][0]


def test_tensor_updates_are_a_subset_with_the_running_shapes_and_dtypes(tmp_path):
    table = checkpoint.read_table(_ckpt(tmp_path / "a"))[1]
    assert checkpoint.tensor_problems(table, [("model.embed_tokens.weight", (16, 8), "bfloat16")]) == []
    found = checkpoint.tensor_problems(table, [("model.embed_tokens.weight", (16, 8), "float32"),
                                               ("model.layers.9.foo.weight", (1,), "bfloat16")])
    assert len(found) == 2 and "float32" in found[1] and "not a weight" in found[0], found


class _Updater:
    """A WeightUpdater's fields the scheduler wrappers read (slotted, as SGLang's dataclass is)."""

    __slots__ = ("model_config", "device", "tp_rank")

    def __init__(self, path):
        self.model_config = types.SimpleNamespace(model_path=str(path))
        self.device, self.tp_rank = "cpu", 0


def _fake_weight_updater_module(monkeypatch):
    mod = types.SimpleNamespace(monkey_patch_torch_reductions=lambda: None,
                                _unwrap_tensor=lambda t, tp_rank, device: t)
    monkeypatch.setitem(sys.modules, wu._WU, mod)


def test_scheduler_tensor_update_refused_before_load_and_never_copied(tmp_path, monkeypatch):
    _fake_weight_updater_module(monkeypatch)
    upd, calls = _Updater(_ckpt(tmp_path / "a")), []
    tpo = wu._wu_tensor(lambda self, named, fmt=None: calls.append(named) or (True, "Success"))
    ok, msg = tpo(upd, [("model.embed_tokens.weight", torch.zeros(16, 8))], None)  # fp32: wrong dtype
    assert not ok and "float32" in msg and "before any weight was copied" in msg and calls == []
    ok, msg = tpo(upd, [("model.embed_tokens.weight", torch.zeros(16, 8, dtype=torch.bfloat16))], None)
    assert ok and len(calls) == 1


def test_a_failure_after_copying_began_marks_the_weights_inconsistent_until_a_full_update(tmp_path, monkeypatch):
    _fake_weight_updater_module(monkeypatch)
    good = _ckpt(tmp_path / "a")
    upd = _Updater(good)

    def dies(self, path, fmt, **kw):
        self.model_config.model_path = path  # as SGLang does before loading
        raise OSError("I/O error mid-file")

    ok, msg = wu._wu_disk(dies)(upd, str(tmp_path / "b"), "auto")
    assert not ok and wu.WEIGHTS_INCONSISTENT in msg and upd.model_config.model_path == str(good)
    before_copy = wu._wu_disk(lambda self, p, f, **kw: (False, "Failed to get weights iterator: x."))
    upd2 = _Updater(good)
    assert before_copy(upd2, "x", "auto") == (False, "Failed to get weights iterator: x.")
    assert wu._sched_state(upd2).inconsistent is None
    # a partial tensor update succeeds but does not clear the state; a full one does
    tensor = wu._wu_tensor(lambda self, named, fmt=None: (True, "Success"))
    one = [("model.embed_tokens.weight", torch.zeros(16, 8, dtype=torch.bfloat16))]
    ok, msg = tensor(upd, one, None)
    assert ok and wu.WEIGHTS_INCONSISTENT in msg
    table = checkpoint.read_table(good)[1]
    full = [(n, torch.zeros(s, dtype=torch.bfloat16)) for n, (s, _) in table.items()]
    ok, msg = tensor(upd, full, None)
    assert ok and wu.WEIGHTS_INCONSISTENT not in msg and wu._sched_state(upd).inconsistent is None


def test_main_process_disk_update_is_checked_before_the_scheduler_is_asked(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_TRUE_ON_POLICY", "1")
    good = _ckpt(tmp_path / "a")
    tm = types.SimpleNamespace(server_args=types.SimpleNamespace(model_path=str(good)))
    asked = []

    async def original(self, obj, request=None):
        asked.append(obj.model_path)
        return True, "Succeeded to update model weights.", 0

    tpo = wu._main_disk(original)
    bad = _ckpt(tmp_path / "b", {**CFG, "moe_intermediate_size": 6}, inter=6)
    for path in (bad, tmp_path / "missing"):
        ok, msg, _ = asyncio.run(tpo(tm, types.SimpleNamespace(model_path=str(path))))
        assert not ok and "refused before any weight was copied" in msg
    assert asked == []
    same = _ckpt(tmp_path / "c", shards=3)
    ok, msg, _ = asyncio.run(tpo(tm, types.SimpleNamespace(model_path=str(same))))
    assert ok and asked == [str(same)] and wu.main_state(tm).path == str(same)


@pytest.mark.parametrize("names, dtypes, shapes, ok", [
    (["model.embed_tokens.weight"], ["bfloat16"], [[16, 8]], True),
    (["model.embed_tokens.weight"], ["float16"], [[16, 8]], False),
    (["model.embed_tokens.weight"], ["bfloat16"], [[16, 9]], False),
    (["model.embed_tokens.weight", "x"], ["bfloat16"], [[16, 8]], False),
])
def test_main_process_distributed_update_judges_the_announced_tensors(tmp_path, monkeypatch, names, dtypes, shapes,
                                                                      ok):
    monkeypatch.setenv("SGLANG_TRUE_ON_POLICY", "1")
    tm = types.SimpleNamespace(server_args=types.SimpleNamespace(model_path=str(_ckpt(tmp_path / "a"))))

    async def original(self, obj, request=None):
        return True, "Succeeded to update parameter online."

    got, msg = asyncio.run(wu._main_dist(original)(tm, types.SimpleNamespace(names=names, dtypes=dtypes,
                                                                             shapes=shapes)))
    assert got is ok, msg


HUB = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 16, "hidden_size": 8,
       "intermediate_size": 12, "moe_intermediate_size": 4, "num_hidden_layers": 1, "num_attention_heads": 2,
       "num_key_value_heads": 1, "head_dim": 4, "num_experts": 1, "num_experts_per_tok": 1, "norm_topk_prob": True,
       "rope_theta": 1000000.0, "rope_scaling": None, "max_position_embeddings": 64, "torch_dtype": "bfloat16"}


def _saved_by_transformers(cfg: dict) -> dict:
    """config.json as this transformers' ``save_pretrained`` writes the model ``cfg`` describes."""
    from transformers import AutoConfig

    return AutoConfig.for_model(**cfg).to_dict()


def test_the_same_model_saved_by_transformers_5_fits_a_hub_checkpoint(tmp_path):
    """A trainer's ``save_pretrained`` of the running model renames fields (``num_local_experts``,
    ``rope_parameters``): the same values, so the update fits."""
    saved = _saved_by_transformers(HUB)
    assert "num_experts" not in saved and "rope_theta" not in saved and "num_local_experts" in saved
    cur = checkpoint.read_table(_ckpt(tmp_path / "hub", HUB))[:2]
    new = checkpoint.read_table(_ckpt(tmp_path / "saved", saved))
    assert new[2] == [] and checkpoint.update_problems(cur, new[:2]) == []


def test_a_change_under_a_renamed_field_is_one_problem_named_once(tmp_path):
    cur = checkpoint.read_table(_ckpt(tmp_path / "hub", HUB))[:2]
    for change, field in (({"num_experts": 2}, "num_experts"), ({"rope_theta": 10000.0}, "rope_parameters")):
        new = checkpoint.read_table(_ckpt(tmp_path / field, _saved_by_transformers({**HUB, **change})))[:2]
        found = checkpoint.update_problems(cur, new)
        assert len(found) == 1 and found[0].startswith(f"config.json {field}:"), found


def test_a_config_transformers_cannot_read_is_refused_with_its_reason(tmp_path):
    cur = checkpoint.read_table(_ckpt(tmp_path / "hub", HUB))[:2]
    new = checkpoint.read_table(_ckpt(tmp_path / "bad", {**HUB, "hidden_size": "eight"}))[:2]
    found = checkpoint.update_problems(cur, new)
    assert len(found) == 1 and "cannot read it" in found[0] and "hidden_size" in found[0], found
