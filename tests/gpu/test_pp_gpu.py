"""GPU tier, two GPUs: pipeline-parallel rollouts (the preview contract) against the one-GPU patched trainer.

Chain (each link bitwise, ``torch.equal`` on the fp32 log-probs; max |d| and the count of differing
tokens printed first): PP2 rollout, CUDA graphs on, mixed prompt lengths (a chunked prefill of 128,
T = 1.0 and 0.7) == the patched transformers trainer on one GPU -> the same requests again (prompts
from the radix cache) == the first pass -> an uneven split (a 30B-A3B-shaped model of 5 layers,
``SGLANG_PP_LAYER_PARTITION=3,2`` and the default 2 + 3, a >= 4k prompt) == the trainer -> after
``update_weights_from_disk`` / ``update_weights_from_tensor`` / ``update_weights_from_distributed``
(weights changed in every layer, so both stages must take them) == the trainer loaded with the
weights now served, and != the rollout before the update.

    pytest -m gpu tests/gpu/test_pp_gpu.py        (skipped with fewer than 2 GPUs)
"""

import json
import shutil
import threading
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
PREVIEW = "qwen3_moe_true_on_policy_tp_preview_v1"
TEMPERATURES = (1.0, 0.7)


@pytest.fixture(autouse=True)
def _two_gpus():
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("pipeline parallel needs 2 GPUs")


def _engine(path, **kwargs):
    from true_on_policy.rollout.engine import TrueOnPolicyEngine

    return TrueOnPolicyEngine(contract=PREVIEW, model_path=path, pp_size=2, mem_fraction_static=0.5,
                              chunked_prefill_size=128, random_seed=0, **kwargs)


def _sample(eng, prompts, t, new=24, seed=900):
    from true_on_policy.harness.parity import sampled

    params = [{"temperature": t, "max_new_tokens": new, "ignore_eos": True, "sampling_seed": seed + i}
              for i in range(len(prompts))]
    return [sampled(o) for o in eng.generate(input_ids=prompts, sampling_params=params)]


def _trainer(path, prompts, outs, t):
    """The patched trainer on one GPU: log-prob of every sampled token (right-padded batches of 8)."""
    import torch
    from transformers import AutoModelForCausalLM

    from true_on_policy.trainer import patch_hf_model, right_pad, token_logprobs

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    patch_hf_model(model)
    seqs = [p + toks for p, (toks, _) in zip(prompts, outs, strict=True)]
    out = []
    with torch.no_grad():
        for i in range(0, len(seqs), 8):
            lp = token_logprobs(model, *right_pad(seqs[i:i + 8], "cuda"), t)
            for r, (ids, p) in enumerate(zip(seqs[i:i + 8], prompts[i:i + 8], strict=True)):
                out.append(lp[r, len(p) - 1:len(ids) - 1].cpu())
    del model
    torch.cuda.empty_cache()
    return torch.cat(out)


def _bitwise(name, outs, trainer) -> dict:
    import torch

    rollout = torch.cat([torch.tensor(lp, dtype=torch.float32) for _, lp in outs])
    d = (rollout.double() - trainer.double()).abs()
    print(f"{name}: tokens={rollout.numel()} max|d|={d.max().item()} differing={(d > 0).sum().item()}")
    assert torch.equal(rollout, trainer), f"{name}: rollout != trainer"
    return {"tokens": int(rollout.numel()), "max_abs_diff": float(d.max()),
            "exact_fraction": float((rollout == trainer).double().mean())}


def _stages(manifests):
    sched = [m for m in manifests if m["role"] == "scheduler"]
    assert sorted(m["ranks"]["pp"] for m in sched) == [0, 1], manifests
    assert all(s["installed"] for m in sched for p in m["patches"] for s in p["symbols"])
    return sched


def test_pp2_rollout_equals_the_one_gpu_trainer(tiny_cache, gpu_evidence):
    from true_on_policy import tiny_model
    from true_on_policy.harness.parity import make_prompts

    path = tiny_model.ensure("wide")  # 4 layers: 2 + 2
    prompts = make_prompts(64, 256, seed=15, min_len=4, max_len=300)
    record = {"test": "pp2_rollout_eq_trainer_wide", "prompt_lens": [len(p) for p in prompts]}
    with _engine(path) as eng:
        runs = {t: (_sample(eng, prompts, t, new=64), _sample(eng, prompts, t, new=64)) for t in TEMPERATURES}
        sched = _stages(eng.manifests())
        record["cuda_graph"] = [m["extra"]["cuda_graph"] for m in sched]
    assert all(cg.get("captured") for cg in record["cuda_graph"]), record["cuda_graph"]
    for t, (first, again) in runs.items():
        assert first == again, f"T={t}: the radix-cache pass differs from the first"
        record[f"t{t}"] = _bitwise(f"PP2 wide T={t}", first, _trainer(path, prompts, first, t))
    gpu_evidence.append(record)


@pytest.mark.parametrize("partition", ["3,2", None])
def test_uneven_pp2_split_with_a_long_prompt(partition, tiny_cache, gpu_evidence, monkeypatch):
    from true_on_policy import tiny_model
    from true_on_policy.harness.parity import make_prompts

    if partition is None:
        monkeypatch.delenv("SGLANG_PP_LAYER_PARTITION", raising=False)
    else:
        monkeypatch.setenv("SGLANG_PP_LAYER_PARTITION", partition)
    path = tiny_model.ensure("a3b5")
    prompts = make_prompts(8, 4096, seed=16, min_len=70, max_len=400) + make_prompts(1, 4096, seed=17, min_len=4200,
                                                                                    max_len=4200)
    with _engine(path, context_length=8192) as eng:
        outs = _sample(eng, prompts, 1.0, new=16)
        sched = _stages(eng.manifests())
    record = {"test": f"pp2_uneven_a3b5_{partition or 'default'}", "partition": partition,
              "stages": {m["ranks"]["pp"]: m["ranks"] for m in sched}, "prompt_lens": [len(p) for p in prompts]}
    record.update(_bitwise(f"PP2 a3b5 partition={partition}", outs, _trainer(path, prompts, outs, 1.0)))
    gpu_evidence.append(record)


def _perturbed_copy(src: str, dst: Path, scale: float = 0.05) -> list[str]:
    """A copy of checkpoint ``src`` whose every tensor is changed (noise, seeded); returns the names."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    g = torch.Generator().manual_seed(7)
    names = []
    for f in sorted(Path(dst).glob("*.safetensors")):
        tensors = load_file(f)
        for k, v in tensors.items():
            tensors[k] = (v.float() + scale * torch.randn(v.shape, generator=g)).to(v.dtype)
            names.append(k)
        save_file(tensors, f, metadata={"format": "pt"})
    return names


def _checkpoint_tensors(path: str, device="cuda"):
    from safetensors.torch import load_file

    return [(k, v.to(device)) for f in sorted(Path(path).glob("*.safetensors")) for k, v in load_file(f).items()]


def test_pp2_weight_updates_keep_parity(tiny_cache, gpu_evidence, tmp_path):
    import torch

    from true_on_policy import tiny_model
    from true_on_policy.harness.parity import make_prompts

    base = tiny_model.ensure("wide")
    new = tmp_path / "perturbed"
    names = _perturbed_copy(base, new)
    cfg = json.loads((Path(base) / "config.json").read_text())
    from true_on_policy.contract.pipeline import layer_id

    assert {layer_id(n) for n in names} >= set(range(cfg["num_hidden_layers"])), "a layer kept its weights"
    prompts = make_prompts(16, 256, seed=18, min_len=4, max_len=200)
    record = {"test": "pp2_weight_updates_wide"}
    with _engine(base) as eng:
        before = _sample(eng, prompts, 1.0)
        ok, msg = eng.engine.update_weights_from_disk(str(new))[:2]
        assert ok, msg
        after_disk = _sample(eng, prompts, 1.0)
        ok, msg = eng.engine.update_weights_from_tensor(_checkpoint_tensors(base))[:2]  # back to the base weights
        assert ok, msg
        after_tensor = _sample(eng, prompts, 1.0)
        after_dist = _update_from_distributed(eng, _checkpoint_tensors(str(new)), prompts)
        _stages(eng.manifests())
    assert [x for x, _ in before] != [x for x, _ in after_disk], "the disk update changed nothing"
    record["disk"] = _bitwise("PP2 after update_weights_from_disk", after_disk,
                              _trainer(str(new), prompts, after_disk, 1.0))
    record["tensor"] = _bitwise("PP2 after update_weights_from_tensor", after_tensor,
                                _trainer(base, prompts, after_tensor, 1.0))
    assert torch.equal(torch.tensor([lp for _, x in after_tensor for lp in x]),
                       torch.tensor([lp for _, x in before for lp in x])), "restoring the base weights is not bitwise"
    record["distributed"] = _bitwise("PP2 after update_weights_from_distributed", after_dist,
                                     _trainer(str(new), prompts, after_dist, 1.0))
    gpu_evidence.append(record)


def _update_from_distributed(eng, tensors, prompts):
    """The trainer is rank 0 of a gloo group with the engine's tp * pp = 2 ranks (NCCL refuses two
    ranks of one communicator on one GPU, and this host has two); broadcast, then sample."""
    import torch
    from sglang.srt.utils import init_custom_process_group
    from sglang.srt.utils.network import get_free_port

    port, group = get_free_port(), "tpo_pp_update"
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("init", eng.engine.init_weights_update_group(
        "127.0.0.1", port, 1, 3, group, backend="gloo")))
    t.start()
    pg = init_custom_process_group(backend="gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=3, rank=0,
                                   group_name=group)
    t.join()
    assert result["init"][0], result["init"]
    t = threading.Thread(target=lambda: result.setdefault("update", eng.engine.update_weights_from_distributed(
        [n for n, _ in tensors], [str(v.dtype).split(".")[-1] for _, v in tensors], [list(v.shape) for _, v in tensors],
        group)))
    t.start()
    for _, v in tensors:
        torch.distributed.broadcast(v, src=0, group=pg)
    t.join()
    assert result["update"][0], result["update"]
    return _sample(eng, prompts, 1.0)
