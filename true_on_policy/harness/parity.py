"""Parity harness — the scoreboard: rollout log-probs vs a trainer's recompute of the same tokens.

    python -m true_on_policy.harness.parity --mode {stock,tpo} [--model-path P | --geometry embedded]
        [--prompts 64] [--new-tokens 64] [--temperature 1.0] [--tp-size 1] [--pp-size 1] --out evidence/X.json

(``--pp-size`` > 1 needs the preview contract; an uneven split comes from ``SGLANG_PP_LAYER_PARTITION``.)

1. start the engine (stock ``sglang.Engine``, or ``TrueOnPolicyEngine``), sample N prompts of
   mixed lengths x T new tokens with log-probs (one seed per prompt), shut it down;
2. recompute log p(token | prefix) of every sampled token with the trainer — today Hugging Face
   transformers' ``Qwen3MoeForCausalLM`` in bf16: fp32 ``log_softmax(logits / T)``;
3. write JSON evidence, whole, at the end (``provenance.write_evidence``): the provenance taken
   at the start (command, imported versions, GPU, git state), contract fingerprint, config,
   ``tokens``, ``mean_abs_diff``, ``max_abs_diff``, ``exact_fraction`` (bitwise-equal fp32 values).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

SCHEMA = "true_on_policy.parity/1"


def make_prompts(n: int, vocab: int, seed: int, min_len: int = 4, max_len: int = 200) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(min_len, max_len + 1, (n,), generator=g).tolist()
    return [torch.randint(0, vocab, (n_,), generator=g).tolist() for n_ in lens]


def sampled(output: dict) -> tuple[list[int], list[float]]:
    """(token ids, their log-probs) of one SGLang generate output."""
    lp = output["meta_info"]["output_token_logprobs"]
    return [int(t[1]) for t in lp], [float(t[0]) for t in lp]


def rollout(mode: str, model_path: str, prompts, new_tokens: int, temperature: float, seed: int, tp_size: int,
            contract: str | None = None, ep_size: int = 1, cuda_graph_max_bs: int | None = None, pp_size: int = 1,
            followups: int = 0, chunked_prefill_size: int | None = None, extend_seed: int = 1,
            mem_fraction: float = 0.5):
    """Sample with SGLang; returns (outputs [(token_ids, logprobs)], manifests, engine kwargs, radix).

    ``followups`` > 0: after the first wave, a second ``generate`` sends, for each of the first
    ``followups`` prompts, its whole sequence (prompt + sampled tokens) plus 16 new tokens, so its
    prefix is a radix-cache hit; those outputs follow the first wave's, and ``radix`` holds their
    prompts and SGLang's ``cached_tokens`` (else ``radix`` is None)."""
    kwargs = dict(model_path=model_path, tp_size=tp_size, random_seed=seed, mem_fraction_static=mem_fraction,
                  log_level="error")
    if chunked_prefill_size:
        kwargs["chunked_prefill_size"] = chunked_prefill_size
    if ep_size > 1:
        kwargs["ep_size"] = ep_size
    if pp_size > 1:
        kwargs["pp_size"] = pp_size
    if cuda_graph_max_bs:
        kwargs["cuda_graph_max_bs_decode"] = cuda_graph_max_bs
    if mode == "stock":
        import sglang

        from true_on_policy import env

        env.disable_overlay()
        kwargs.update(attention_backend="triton", sampling_backend="pytorch",
                      disable_custom_all_reduce=tp_size > 1)  # FA3 is not in the GPU bundle
        engine, manifests = sglang.Engine(**kwargs), lambda: []
    elif mode == "tpo":
        from true_on_policy import DEFAULT_CONTRACT
        from true_on_policy.rollout.engine import TrueOnPolicyEngine

        engine = TrueOnPolicyEngine(contract=contract or DEFAULT_CONTRACT, **kwargs)
        manifests = engine.manifests
    else:
        raise ValueError(f"unknown mode {mode!r}; use stock or tpo")
    try:
        def params(first: int, n: int) -> list[dict]:  # request r of the run gets seed seed * 100003 + r
            return [{"temperature": temperature, "max_new_tokens": new_tokens, "ignore_eos": True,
                     "sampling_seed": seed * 100_003 + first + i} for i in range(n)]

        outs = [sampled(o) for o in engine.generate(input_ids=prompts, sampling_params=params(0, len(prompts)),
                                                    return_logprob=True)]
        radix = None
        if followups:
            extra = make_prompts(followups, 256, seed + extend_seed, 16, 16)
            second = [prompts[i] + outs[i][0] + extra[i] for i in range(followups)]
            raw = engine.generate(input_ids=second, sampling_params=params(len(prompts), followups),
                                  return_logprob=True)
            radix = {"prompts": second, "cached_tokens": [int(o["meta_info"].get("cached_tokens", 0)) for o in raw]}
            outs += [sampled(o) for o in raw]
        return outs, manifests(), kwargs, radix
    finally:
        engine.shutdown()


def _batches(lengths: list[int], batch_size: int, max_tokens: int) -> list[list[int]]:
    """Consecutive index groups of at most ``batch_size`` sequences whose padded size (count x
    longest) stays within ``max_tokens`` (a longer sequence goes alone). Batching changes no bit
    of a row (the kernels are batch-invariant); it only bounds the fp32 logits' memory."""
    out, cur, longest = [], [], 0
    for i, n in enumerate(lengths):
        if cur and (len(cur) == batch_size or (len(cur) + 1) * max(longest, n) > max_tokens):
            out.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    return out + ([cur] if cur else [])


def patched_response_logprobs(model, sequences, prompt_lens, temperature: float, batch_size: int = 8,
                              max_tokens: int = 16384, device="cuda") -> list:
    """Each sequence's log-probs from its prompt on (fp32, one tensor per sequence), by a patched
    model in right-padded batches, lm_head run only from each batch's shortest prompt on
    (``token_logprobs(..., logits_to_keep=)``): the same bits as the whole sequence's slice."""
    import torch

    from true_on_policy.trainer import right_pad, token_logprobs

    out = []
    with torch.no_grad():
        for idx in _batches([len(x) for x in sequences], batch_size, max_tokens):
            ids, mask = right_pad([sequences[i] for i in idx], device)
            first = min(prompt_lens[i] for i in idx) - 1  # the first log-prob column any row needs
            lp = token_logprobs(model, ids, mask, temperature, logits_to_keep=ids.shape[1] - 1 - first)
            for r, i in enumerate(idx):  # lp column j is the full result's column first + j
                out.append(lp[r, prompt_lens[i] - 1 - first:len(sequences[i]) - 1 - first].cpu())
    return out


def trainer_logprobs(model_path: str, sequences, prompt_lens, temperature: float, trainer: str = "hf",
                     batch_size: int = 8, max_tokens: int = 16384, contract: str | None = None):
    """Trainer recompute at each sampled token. ``hf``: stock transformers bf16, fp32
    log_softmax(logits / T), one sequence at a time. ``patched``: the same model through
    ``true_on_policy.trainer`` under ``contract`` (default: true_on_policy.DEFAULT_CONTRACT), right-padded batches of ``batch_size``,
    lm_head run only from the batch's shortest prompt on (``token_logprobs(..., logits_to_keep=)``)."""
    import torch
    from transformers import AutoModelForCausalLM

    try:  # straight to the GPU (a 30B checkpoint would otherwise sit in host memory first); needs accelerate
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16, device_map="cuda").eval()
    except (ValueError, ImportError):
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16).cuda().eval()
    out = []
    info = {"trainer": f"transformers.Qwen3MoeForCausalLM ({trainer})", "dtype": "bfloat16",
            "attn_implementation": model.config._attn_implementation}
    if trainer == "patched":
        from true_on_policy import DEFAULT_CONTRACT
        from true_on_policy.trainer import patch_hf_model

        info["trainer_manifest"] = patch_hf_model(model, contract or DEFAULT_CONTRACT).to_dict()
        out = patched_response_logprobs(model, sequences, prompt_lens, temperature, batch_size, max_tokens, "cuda")
    elif trainer == "hf":
        with torch.no_grad():
            for ids, p in zip(sequences, prompt_lens, strict=True):
                x = torch.tensor([ids], device="cuda")
                logits = model(input_ids=x).logits[0].float()
                lp = torch.log_softmax(logits[:-1] / temperature, dim=-1)
                tok = lp.gather(-1, x[0, 1:, None])[:, 0]
                out.append(tok[p - 1:].cpu())
    else:
        raise ValueError(f"unknown trainer {trainer!r} (hf, patched)")
    del model
    torch.cuda.empty_cache()
    return out, info


def compare(rollout_lps: list[list[float]], trainer_lps) -> dict:
    import torch

    r = torch.cat([torch.tensor(x, dtype=torch.float32) for x in rollout_lps])
    t = torch.cat([x.to(torch.float32) for x in trainer_lps])
    if r.shape != t.shape:
        raise ValueError(f"rollout has {r.numel()} log-probs, trainer {t.numel()}")
    d = (r.double() - t.double()).abs()
    return {"tokens": int(r.numel()), "mean_abs_diff": float(d.mean()), "max_abs_diff": float(d.max()),
            "exact_fraction": float((r == t).double().mean()), "exact_tokens": int((r == t).sum())}


def run(args) -> dict:
    from true_on_policy import DEFAULT_CONTRACT, env, tiny_model
    from true_on_policy.contract import get_contract
    from true_on_policy.contract.policy import read_architectures
    from true_on_policy.patches import speed_modes

    model_path = args.model_path or tiny_model.ensure(args.geometry)
    cfg = json.loads((Path(model_path) / "config.json").read_text())
    prompts = make_prompts(args.prompts, min(cfg["vocab_size"], 256), args.seed)
    if args.long_prompts:  # long prompts, mixed into the same batch (chunked when longer than the chunk)
        prompts += make_prompts(args.long_prompts, min(cfg["vocab_size"], 256), args.seed + 7, args.long_len,
                                args.long_len)
    t0 = time.time()
    outs, manifests, engine_kwargs, radix = rollout(
        args.mode, model_path, prompts, args.new_tokens, args.temperature, args.seed, args.tp_size, args.contract,
        args.ep_size, args.cuda_graph_max_bs, args.pp_size, args.radix_followups, args.chunked_prefill_size,
        mem_fraction=args.mem)
    t_rollout = time.time() - t0
    all_prompts = prompts + (radix["prompts"] if radix else [])
    seqs = [p + toks for p, (toks, _) in zip(all_prompts, outs, strict=True)]
    trainer, trainer_info = trainer_logprobs(model_path, seqs, [len(p) for p in all_prompts], args.temperature,
                                            args.trainer, contract=args.contract)
    stats = compare([lps for _, lps in outs], trainer)
    contract = get_contract(args.contract or DEFAULT_CONTRACT)
    return {
        "schema": SCHEMA,
        "mode": args.mode,
        "contract": contract.name if args.mode == "tpo" else None,
        "fingerprint": contract.fingerprint if args.mode == "tpo" else None,
        "config": {"model_path": model_path, "architectures": read_architectures(model_path),
                   "geometry": None if args.model_path else args.geometry, "prompts": args.prompts,
                   "new_tokens": args.new_tokens, "temperature": args.temperature, "seed": args.seed,
                   "tp_size": args.tp_size, "ep_size": args.ep_size, "pp_size": args.pp_size,
                   "pp_layer_partition": env.PP_LAYER_PARTITION.get(), "engine_kwargs": engine_kwargs,
                   "long_prompts": args.long_prompts, "long_len": args.long_len if args.long_prompts else None,
                   "prompt_lengths": [len(p) for p in all_prompts],
                   "chunked_prefill_size": args.chunked_prefill_size, **speed_modes(), **trainer_info},
        "radix_followups": None if radix is None else {"count": len(radix["prompts"]),
                                                       "cached_tokens": radix["cached_tokens"]},
        **stats,
        "rollout_seconds": round(t_rollout, 2),
        "manifests": manifests,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m true_on_policy.harness.parity", description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=("stock", "tpo"), required=True)
    p.add_argument("--model-path")
    p.add_argument("--geometry", default="embedded", help="tiny checkpoint to build when no --model-path")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--ep-size", type=int, default=1)
    p.add_argument("--pp-size", type=int, default=1, help="pipeline stages (preview contract; uneven split: "
                   "SGLANG_PP_LAYER_PARTITION)")
    p.add_argument("--cuda-graph-max-bs", type=int, help="largest captured decode batch (SGLang's default if unset)")
    p.add_argument("--contract", help="true-on-policy contract for --mode tpo (default: true_on_policy.DEFAULT_CONTRACT)")
    p.add_argument("--trainer", choices=("hf", "patched"), default="hf",
                   help="recompute with stock transformers (hf) or through true_on_policy.trainer (patched)")
    p.add_argument("--long-prompts", type=int, default=0, help="add this many prompts of --long-len tokens")
    p.add_argument("--long-len", type=int, default=8192)
    p.add_argument("--radix-followups", type=int, default=0,
                   help="then send this many whole sequences again (plus 16 tokens): radix-cache hits")
    p.add_argument("--chunked-prefill-size", type=int, help="SGLang's prefill chunk (its default if unset)")
    p.add_argument("--mem", type=float, default=0.5,
                   help="SGLang's mem_fraction_static, in (0, 1); 0.5 of an 80 GB card is less than the 48-layer "
                   "geometry's 57 GB of weights")
    p.add_argument("--out", required=True, help="evidence JSON path")
    args = p.parse_args(argv)
    if not 0 < args.mem < 1:
        p.error(f"--mem {args.mem}: SGLang's mem_fraction_static must be in (0, 1)")
    from true_on_policy.harness.provenance import provenance, write_evidence

    prov = provenance(None if argv is None else ["python", "-m", "true_on_policy.harness.parity", *argv])
    evidence = run(args)
    write_evidence(args.out, evidence, prov)
    keys = ("mode", "tokens", "mean_abs_diff", "max_abs_diff", "exact_fraction", "rollout_seconds")
    print(json.dumps({k: evidence[k] for k in keys}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
