"""A small GRPO-style RL loop on one GPU, the way a user runs one: ``TrueOnPolicyEngine`` rollouts,
the patched transformers trainer, a weight push after every optimizer step; at every step the
rollout's log-probs must equal the trainer's recompute bitwise (in-process;
``true_on_policy.rollout.ray`` is the actor form).

    python -m true_on_policy.harness.rl_loop [--geometry embedded] [--steps 100] [--prompts 8] [--group 4] \\
        [--new-tokens 32] [--lr 1e-4] [--push tensor|disk] [--contract NAME] --out OUT.json

Step s: every prompt is sampled ``--group`` times (T = 1.0, one seed per sample, log-probs on);
the trainer recomputes the sampled tokens' log-probs with gradients (``token_logprobs``) and they
are compared with the rollout's (``torch.equal`` per step, recorded); a toy reward (the share of
even token ids) gives group-normalised advantages; loss = -mean(advantage x log-prob); one AdamW
step; the new weights go to the engine (``update_weights_from_tensor`` with the checkpoint's
names, or ``update_weights_from_disk`` from a ``save_pretrained`` folder). The handshake
(``check_rollout``) runs first. Exit code 1 if any step is not bitwise. ``--contract``: the engine
and the trainer under another contract (default: true_on_policy.DEFAULT_CONTRACT); the evidence names it and its
fingerprint, and an unknown name is refused before any GPU work.
"""

from __future__ import annotations

import argparse
import sys
import tempfile


def _advantages(rewards, group: int):
    import torch

    r = torch.tensor(rewards, dtype=torch.float32).view(-1, group)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)).view(-1)


def group_inputs(n_prompts: int, group: int, vocab: int, seed: int) -> list[list[int]]:
    """Every prompt ``group`` times in a row (a GRPO group per prompt)."""
    from true_on_policy.harness.parity import make_prompts

    return [p for p in make_prompts(n_prompts, min(vocab, 256), seed, 8, 64) for _ in range(group)]


def step_params(step: int, n: int, new_tokens: int) -> list[dict]:
    """Step ``step``'s sampling parameters: T = 1.0, one seed per sample, never reused across steps."""
    return [{"temperature": 1.0, "max_new_tokens": new_tokens, "ignore_eos": True,
             "sampling_seed": 1_000_003 * step + i} for i in range(n)]


def compare(inputs, outs, lp):
    """The trainer's log-probs ``lp`` [B, S-1] of the right-padded ``inputs[r] + outs[r][0]`` at the
    sampled tokens (one row slice per sample, gradients kept) and their record against the
    rollout's ``outs[r][1]``: ``torch.equal``, max |d|, the token count."""
    import torch

    mine = [lp[r, len(p) - 1:len(p) - 1 + len(t)] for r, (p, (t, _)) in enumerate(zip(inputs, outs, strict=True))]
    got = torch.cat([m.detach().float().cpu() for m in mine])
    want = torch.tensor([x for _, lps in outs for x in lps], dtype=torch.float32)
    diff = (got.double() - want.double()).abs()
    return mine, {"tokens": int(want.numel()), "bitwise": bool(torch.equal(got, want)), "max_abs_diff": float(diff.max())}


def grpo_terms(inputs, outs, lp, group: int):
    """The step's loss and record (``compare``'s, and the mean reward): a toy reward (the share of
    even token ids), group-normalised advantages, loss = -mean(advantage x log-prob)."""
    import torch

    mine, record = compare(inputs, outs, lp)
    rewards = [sum(1 for x in t if x % 2 == 0) / max(len(t), 1) for t, _ in outs]
    adv = _advantages(rewards, group).to(lp.device)
    loss = -torch.stack([(adv[r] * m).sum() for r, m in enumerate(mine)]).sum() / sum(len(t) for t, _ in outs)
    return loss, {**record, "mean_reward": sum(rewards) / len(rewards)}


def _push(eng, model, how: str, folder: str) -> None:
    from true_on_policy.rollout.actor import checked, checkpoint_named_tensors

    if how == "tensor":  # in-process sglang.Engine serializes each CUDA tensor for its scheduler (IPC)
        named = [(n, t.detach()) for n, t in checkpoint_named_tensors(model)]
        checked(eng.engine.update_weights_from_tensor(named_tensors=named), "update_weights_from_tensor")
    else:
        model.save_pretrained(folder)
        checked(eng.engine.update_weights_from_disk(folder), "update_weights_from_disk")


def contract_named(name):
    """The contract the loop runs under (``--contract``, else the default); unknown names raise."""
    from true_on_policy import DEFAULT_CONTRACT
    from true_on_policy.contract import get_contract

    return get_contract(name or DEFAULT_CONTRACT)


def run(a) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from true_on_policy import tiny_model
    from true_on_policy.harness.parity import sampled
    from true_on_policy.rollout.engine import TrueOnPolicyEngine
    from true_on_policy.trainer import check_rollout, patch_hf_model, right_pad, token_logprobs

    contract = contract_named(a.contract)
    model_path = a.model_path or tiny_model.ensure(a.geometry)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16).cuda().eval()
    patch_hf_model(model, contract.name)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
    inputs = group_inputs(a.prompts, a.group, model.config.vocab_size, a.seed)
    steps = []
    with TrueOnPolicyEngine(contract=contract.name, model_path=model_path, mem_fraction_static=0.3,
                            random_seed=a.seed) as eng, \
            tempfile.TemporaryDirectory(prefix="tpo-rl-") as folder:
        check_rollout(eng, model)
        for s in range(a.steps):
            params = step_params(s, len(inputs), a.new_tokens)
            outs = [sampled(o) for o in eng.generate(input_ids=inputs, sampling_params=params)]
            ids, mask = right_pad([p + t for p, (t, _) in zip(inputs, outs, strict=True)], "cuda")
            lp = token_logprobs(model, ids, mask, 1.0)  # [B, S-1], with gradients
            loss, record = grpo_terms(inputs, outs, lp, a.group)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            _push(eng, model, a.push, folder)
            steps.append({"step": s, **record, "loss": float(loss)})
            print(f"step {s}: bitwise={steps[-1]['bitwise']} max|d|={steps[-1]['max_abs_diff']:.3g} "
                  f"reward={steps[-1]['mean_reward']:.3f}", flush=True)
    return {"contract": contract.name, "fingerprint": contract.fingerprint, "model_path": model_path,
            "geometry": None if a.model_path else a.geometry, "steps_run": len(steps),
            "prompts": a.prompts, "group": a.group, "new_tokens": a.new_tokens, "lr": a.lr, "push": a.push,
            "all_bitwise": all(x["bitwise"] for x in steps), "steps": steps}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m true_on_policy.harness.rl_loop", description=__doc__.split("\n")[0])
    p.add_argument("--geometry", default="embedded")
    p.add_argument("--model-path")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--push", choices=("tensor", "disk"), default="tensor")
    p.add_argument("--contract", help="the engine and the trainer under this contract (default: true_on_policy.DEFAULT_CONTRACT)")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    from true_on_policy.contract import UnknownContractError

    try:
        contract_named(a.contract)  # an unknown name is refused here, before any GPU work
    except UnknownContractError as e:
        p.error(str(e))
    from true_on_policy.harness.provenance import provenance, write_evidence

    prov = provenance(None if argv is None else ["python", "-m", "true_on_policy.harness.rl_loop", *argv])
    result = run(a)
    write_evidence(a.out, result, prov)
    return 0 if result["all_bitwise"] else 1


if __name__ == "__main__":
    sys.exit(main())
