"""GPU tier: the Ray rollout actor (``true_on_policy.rollout.ray.RolloutEngine``), one actor on one GPU,
against the patched trainer in this process.

Chain: the actor starts under the contract (every scheduler manifest, ``check_rollout`` passes)
-> its samples == the patched trainer's recompute, bitwise -> after ``update_weights_from_disk``
and after ``update_weights_from_tensor`` (CUDA IPC) the same holds for the new weights, and the
samples differ from the old weights' (the update took) -> the first sampled token comes from the
eager prefill, the rest from CUDA-graph decode: were a weight tensor swapped under a captured
graph (instead of copied into), decode would read the old weights and the decode tokens would
differ from the trainer's while the prefill token matched. ``update_weights_from_distributed``
needs a second GPU (NCCL refuses two ranks on one device).
"""

import shutil

import pytest

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.gpu

N_PROMPTS, NEW_TOKENS, T = 8, 24, 1.0


@pytest.fixture(scope="module")
def cluster(tiny_cache):
    from true_on_policy.harness.colocated import worker_env

    workers = worker_env()  # the checkout and the driver's PYTHONPATH (on a bundle host, where Ray itself lives)
    ray.init(include_dashboard=False, runtime_env={"env_vars": workers})
    yield {**workers, "TRUE_ON_POLICY_CACHE": tiny_cache}
    ray.shutdown()


@pytest.fixture(scope="module")
def actor(cluster):
    from true_on_policy import tiny_model
    from true_on_policy.rollout.ray import RolloutEngine

    Actor = RolloutEngine.remote_class(num_gpus=1, runtime_env_base={"env_vars": cluster})
    eng = Actor.remote(model_path=tiny_model.ensure(), mem_fraction_static=0.3, cuda_graph_max_bs_decode=16)
    ray.get(eng.fingerprint.remote(), timeout=600)  # started (or its error raised here)
    yield eng
    ray.get(eng.shutdown.remote(), timeout=300)


@pytest.fixture(scope="module")
def trainer(actor):
    """The patched trainer in this process: on another GPU than the actor's when there are two
    (NCCL weight sync needs it), else on the same one."""
    import torch
    from transformers import AutoModelForCausalLM

    from true_on_policy import tiny_model
    from true_on_policy.trainer import patch_hf_model

    actor_gpu = int(ray.get(actor.gpu_ids.remote())[0])
    dev = next((d for d in range(torch.cuda.device_count()) if d != actor_gpu), 0)
    torch.cuda.set_device(dev)
    model = AutoModelForCausalLM.from_pretrained(tiny_model.ensure(), dtype=torch.bfloat16).to(f"cuda:{dev}").eval()
    patch_hf_model(model)
    return model


def _rollout(eng):
    from true_on_policy.harness.parity import make_prompts

    prompts = make_prompts(N_PROMPTS, 256, seed=11)
    params = [{"temperature": T, "max_new_tokens": NEW_TOKENS, "ignore_eos": True, "sampling_seed": 500 + i}
              for i in range(N_PROMPTS)]
    return prompts, ray.get(eng.generate.remote(input_ids=prompts, sampling_params=params), timeout=600)


def _parity(model, prompts, records) -> dict:
    """Trainer recompute of every sampled token; max |d| and differing counts, printed first, for the
    prefill token (position 0, eager) and the decode tokens (CUDA graphs)."""
    import torch

    from true_on_policy.trainer import right_pad, token_logprobs

    seqs = [p + r["output_ids"] for p, r in zip(prompts, records, strict=True)]
    with torch.no_grad():
        lp = token_logprobs(model, *right_pad(seqs, "cuda"), temperature=T)
    t = torch.stack([lp[i, len(p) - 1:len(s) - 1].cpu() for i, (p, s) in enumerate(zip(prompts, seqs, strict=True))])
    r = torch.tensor([x["logprobs"] for x in records], dtype=torch.float32)
    d = (r.double() - t.double()).abs()
    out = {"max_abs_diff": float(d.max()), "differing": int((d > 0).sum()),
           "prefill_differing": int((d[:, 0] > 0).sum()), "decode_differing": int((d[:, 1:] > 0).sum()),
           "tokens": int(r.numel())}
    print(f"parity: max|d|={out['max_abs_diff']} differing={out['differing']} "
          f"(prefill {out['prefill_differing']}, decode {out['decode_differing']})")
    return out


def _perturb(model, seed):
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1 + 0.05 * torch.randn(p.shape, generator=g, device="cuda", dtype=torch.float32).to(p.dtype))


def test_actor_starts_under_the_contract_and_matches_the_trainer(actor, trainer, gpu_evidence):
    from true_on_policy.trainer import check_rollout

    manifests = check_rollout(actor, trainer)
    sched = [m for m in manifests if m["role"] == "scheduler"]
    assert len(sched) == 1 and all(s["installed"] for m in sched for p in m["patches"] for s in p["symbols"])
    prompts, records = _rollout(actor)
    assert len({r["sampling_seed"] for r in records}) == N_PROMPTS
    res = _parity(trainer, prompts, records)
    gpu_evidence.append({"test": "ray_actor_initial", **res})
    assert res["differing"] == 0 and res["max_abs_diff"] == 0.0


def test_update_from_disk_keeps_parity(actor, trainer, tmp_path, gpu_evidence):
    from true_on_policy import tiny_model

    prompts, before = _rollout(actor)
    _perturb(trainer, seed=1)
    folder = tmp_path / "step1"
    shutil.copytree(tiny_model.ensure(), folder)
    for f in folder.glob("*.safetensors"):
        f.unlink()
    trainer.save_pretrained(folder)  # the patch replaces forwards only: the same state dict
    ray.get(actor.update_weights_from_disk.remote(str(folder)), timeout=600)
    _, after = _rollout(actor)
    assert [r["logprobs"] for r in after] != [r["logprobs"] for r in before]  # the update took
    res = _parity(trainer, prompts, after)
    gpu_evidence.append({"test": "ray_update_from_disk", **res})
    assert res["differing"] == 0 and res["max_abs_diff"] == 0.0


def test_update_from_tensor_under_cuda_graphs_keeps_parity(actor, trainer, gpu_evidence):
    """CUDA IPC from this process; decode runs the graphs captured at start (8 sequences, captured
    sizes up to 16): a swapped tensor shows as decode tokens off while the prefill token matches."""
    from true_on_policy.rollout.actor import checkpoint_named_tensors
    from true_on_policy.rollout.ray import ipc_named_tensors

    [sched] = [m for m in ray.get(actor.manifests.remote()) if m["role"] == "scheduler"]
    graphs = sched["extra"].get("cuda_graph", {})
    assert graphs.get("captured") and max(graphs["decode_batch_sizes"]) >= N_PROMPTS, graphs
    prompts, before = _rollout(actor)
    for seed in (2, 3):  # two updates in a row, each checked
        _perturb(trainer, seed=seed)
        named = list(checkpoint_named_tensors(trainer))
        ray.get(actor.update_weights_from_tensor.remote(ipc_named_tensors(named)), timeout=600)
        _, after = _rollout(actor)
        assert [r["logprobs"] for r in after] != [r["logprobs"] for r in before]
        res = _parity(trainer, prompts, after)
        gpu_evidence.append({"test": f"ray_update_from_tensor_{seed}", **res})
        assert res["prefill_differing"] == 0 and res["decode_differing"] == 0 and res["max_abs_diff"] == 0.0
        before = after


def test_update_from_distributed_keeps_parity(actor, trainer, gpu_evidence):
    import torch
    from helpers import _free_port

    if torch.cuda.device_count() < 2:
        pytest.skip("NCCL needs the trainer and the rollout on different GPUs")
    from sglang.srt.utils import init_custom_process_group

    from true_on_policy.rollout.actor import checkpoint_named_tensors

    actor_gpu = int(ray.get(actor.gpu_ids.remote())[0])
    if trainer.device.index == actor_gpu:
        pytest.skip(f"the trainer shares GPU {actor_gpu} with the actor")
    port = _free_port()
    ref = actor.init_weights_update_group.remote("127.0.0.1", port, 1, 2, "tpo_sync")
    group = init_custom_process_group(backend="nccl", init_method=f"tcp://127.0.0.1:{port}", world_size=2,
                                      rank=0, group_name="tpo_sync")
    ray.get(ref, timeout=300)
    prompts, before = _rollout(actor)
    _perturb(trainer, seed=4)
    named = [(n, t.contiguous()) for n, t in checkpoint_named_tensors(trainer)]
    ref = actor.update_weights_from_distributed.remote([n for n, _ in named], [str(t.dtype).split(".")[1] for _, t in named],
                                                       [list(t.shape) for _, t in named], "tpo_sync")
    for _, t in named:
        torch.distributed.broadcast(t, src=0, group=group)
    ray.get(ref, timeout=600)
    _, after = _rollout(actor)
    assert [r["logprobs"] for r in after] != [r["logprobs"] for r in before]
    res = _parity(trainer, prompts, after)
    gpu_evidence.append({"test": "ray_update_from_distributed", **res})
    assert res["differing"] == 0 and res["max_abs_diff"] == 0.0
