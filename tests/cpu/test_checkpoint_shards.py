"""The real-shape checkpoint writer: ``save_in_shards`` writes the tensors, config and generation
config ``save_pretrained`` writes (the same names and bits), in shards of whole layers."""

import json

import torch
from safetensors.torch import load_file
from transformers import Qwen3MoeForCausalLM

from true_on_policy import tiny_model


def _tensors(folder):
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_save_in_shards_writes_what_save_pretrained_writes(tmp_path):
    spec = {k: v for k, v in tiny_model.WIDE.items() if k != "seed"}
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(tiny_model.hf_config(spec, eos_token_id=1, bos_token_id=None, pad_token_id=0))
    model.to(torch.bfloat16)
    whole, shards = tmp_path / "whole", tmp_path / "shards"
    model.save_pretrained(whole)
    tiny_model.save_in_shards(model, shards, shard_bytes=2**20)
    a, b = _tensors(whole), _tensors(shards)
    assert sorted(a) == sorted(b)
    assert all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
    index = json.loads((shards / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in shards.glob("*.safetensors"))
    assert len(files) > 1 and sorted(set(index["weight_map"].values())) == files
    assert sorted(index["weight_map"]) == sorted(b)
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in b.values())
    for name in files:  # whole layers a shard: a layer's tensors never span two files
        layers = {k.split(".")[2] for k in load_file(shards / name) if k.startswith("model.layers.")}
        assert all(index["weight_map"][k] == name for k in b if k.startswith("model.layers.") and k.split(".")[2] in layers)
    for f in ("config.json", "generation_config.json"):
        assert json.loads((whole / f).read_text()) == json.loads((shards / f).read_text())
