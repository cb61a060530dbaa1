"""GPU tier, the layouts of issue 13 end to end on one GPU: a YaRN model (original context 64,
every prompt past it), a group-3 model (6 query / 2 KV heads: the 64-row attention tile holds 21
tokens) and an odd-vocabulary model (3001; SGLang pads its lm_head to 3008 and slices).

Chain (each link bitwise, ``torch.equal`` on the fp32 log-probs): rollout (CUDA graphs, chunked
prefill of 128, mixed prompt lengths 70..300, T = 1.0 and 0.7) == patched transformers trainer ->
the same requests again (prompts from the radix cache) == the first pass -> YaRN only: a trainer
with plain RoPE on the same weights differs (YaRN really ran on both sides).

    pytest -m gpu tests/gpu/test_layouts_rollout_gpu.py
"""

import pytest

pytestmark = pytest.mark.gpu
N_PROMPTS, NEW = 8, 24
TEMPERATURES = (1.0, 0.7)


def _rollout(path, prompts):
    from true_on_policy.harness.parity import sampled
    from true_on_policy.rollout.engine import TrueOnPolicyEngine

    out = {}
    with TrueOnPolicyEngine(model_path=path, mem_fraction_static=0.3, chunked_prefill_size=128, random_seed=0) as eng:
        for t in TEMPERATURES:
            params = [{"temperature": t, "max_new_tokens": NEW, "ignore_eos": True, "sampling_seed": 900 + i}
                      for i in range(len(prompts))]
            first = [sampled(o) for o in eng.generate(input_ids=prompts, sampling_params=params)]
            again = [sampled(o) for o in eng.generate(input_ids=prompts, sampling_params=params)]
            out[t] = first, again
        manifests = eng.manifests()
    return out, manifests


def _trainer(path, seqs, prompt_lens, temperature, plain_rope=False):
    """The patched trainer's log-prob of every sampled token (right-padded batches of 8)."""
    import torch
    from transformers import AutoModelForCausalLM

    from true_on_policy.trainer import patch_hf_model, right_pad, token_logprobs

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    patch_hf_model(model)
    if plain_rope:  # the same weights with default RoPE: what the rollout ran before YaRN was routed
        model.model.rotary_emb._tp_rope_scaling = None
    out = []
    with torch.no_grad():
        for i in range(0, len(seqs), 8):
            lp = token_logprobs(model, *right_pad(seqs[i:i + 8], "cuda"), temperature)
            for r, (ids, p) in enumerate(zip(seqs[i:i + 8], prompt_lens[i:i + 8], strict=True)):
                out.append(lp[r, p - 1:len(ids) - 1].cpu())
    del model
    torch.cuda.empty_cache()
    return torch.cat(out)


@pytest.mark.parametrize("geometry", ["yarn", "group3", "vocab3001"])
def test_rollout_equals_trainer_on_issue13_layouts(geometry, tiny_cache, gpu_evidence):
    import json
    from pathlib import Path

    import torch

    from true_on_policy import tiny_model
    from true_on_policy.harness.parity import make_prompts

    path = tiny_model.ensure(geometry)
    cfg = json.loads((Path(path) / "config.json").read_text())
    prompts = make_prompts(N_PROMPTS, 256, seed=13, min_len=70, max_len=300)
    runs, manifests = _rollout(path, prompts)
    sched = [m for m in manifests if m["role"] == "scheduler"]
    assert len(sched) == 1, manifests
    record = {"test": f"rollout_eq_trainer_{geometry}", "config": {k: cfg.get(k) for k in (
        "vocab_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rope_parameters",
        "max_position_embeddings")}, "prompt_lens": [len(p) for p in prompts]}
    for t, (first, again) in runs.items():
        assert [x for x, _ in first] == [x for x, _ in again], f"T={t}: radix-cache pass drew other tokens"
        rollout = torch.cat([torch.tensor(lp, dtype=torch.float32) for _, lp in first])
        cached = torch.cat([torch.tensor(lp, dtype=torch.float32) for _, lp in again])
        seqs = [p + toks for p, (toks, _) in zip(prompts, first, strict=True)]
        trainer = _trainer(path, seqs, [len(p) for p in prompts], t)
        d = (rollout.double() - trainer.double()).abs()
        print(f"{geometry} T={t}: tokens={rollout.numel()} max|d|={d.max().item()} differing={(d > 0).sum().item()}")
        record[f"t{t}"] = {"tokens": int(rollout.numel()), "max_abs_diff": float(d.max()),
                           "exact_fraction": float((rollout == trainer).double().mean()),
                           "radix_pass_bitwise": bool(torch.equal(rollout, cached))}
        assert torch.equal(rollout, cached), f"T={t}: radix-cache pass != first pass"
        assert torch.equal(rollout, trainer), f"T={t}: rollout != trainer"
        if geometry == "yarn" and t == 1.0:
            plain = _trainer(path, seqs, [len(p) for p in prompts], t, plain_rope=True)
            record["plain_rope_trainer_max_abs_diff"] = float((rollout.double() - plain.double()).abs().max())
            assert not torch.equal(rollout, plain), "a plain-RoPE trainer agrees: YaRN did not run"
    gpu_evidence.append(record)
