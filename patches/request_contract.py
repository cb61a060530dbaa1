"""Per-request contract seam (sglang/srt/managers/tokenizer_manager.py ``_create_tokenized_object``,
main process): every request is judged on the sampling parameters SGLang will actually use --
after ``--preferred-sampling-params``, the model's ``generation_config.json`` defaults that the
OpenAI routes merge in (``--sampling-defaults model``) and SGLang's own normalisation -- and
refused before it is scheduled when they leave the contract.

The refusal is a ``ValueError`` listing every problem and its fix: SGLang answers it with HTTP 400
on ``/generate`` and the OpenAI routes, and raises it from ``Engine.generate``. Nothing reaches a
scheduler, so the server keeps serving.

Refused, because they change the logits before the sampler (the reported log-prob would include
them, the trainer's would not) or return data the contract does not produce:
frequency / presence / repetition penalties, ``logit_bias``, grammars (json_schema, regex, ebnf,
structural_tag), ``min_new_tokens``, custom logit processors and thinking budgets,
``return_routed_experts`` (the contract's router bypasses SGLang's capture site) and sampling masks.
Supported on both sides: temperature, top_k, top_p, min_p (``kernels/sampling``), seeds, n.
"""

from __future__ import annotations

from true_on_policy.manifest import PatchRecord
from true_on_policy.patching import after, wrap

CREATE = "sglang.srt.managers.tokenizer_manager.TokenizerManager._create_tokenized_object"
_DEFAULTS_HINT = ("if you did not send it, it came from --preferred-sampling-params or the model's "
                  "generation_config.json (--sampling-defaults openai turns those defaults off)")


class RequestContractError(ValueError):
    status_code = 400


def problems(sp, obj) -> list[str]:
    """Every way the resolved ``SamplingParams`` ``sp`` and the request ``obj`` leave the contract."""
    out = []

    def bad(cond, what, why, fix):
        if cond:
            out.append(f"{what}: {why} -> {fix}")

    changes = "changes the logits before sampling, so the reported log-prob would include it and the trainer's would not"
    bad(getattr(sp, "frequency_penalty", 0.0) != 0.0, f"frequency_penalty={sp.frequency_penalty}", changes,
        f"send 0.0 ({_DEFAULTS_HINT})")
    bad(getattr(sp, "presence_penalty", 0.0) != 0.0, f"presence_penalty={sp.presence_penalty}", changes,
        f"send 0.0 ({_DEFAULTS_HINT})")
    bad(getattr(sp, "repetition_penalty", 1.0) != 1.0, f"repetition_penalty={sp.repetition_penalty}", changes,
        f"send 1.0 ({_DEFAULTS_HINT})")
    bad(bool(getattr(sp, "logit_bias", None)), "logit_bias", changes, "drop it")
    for g in ("json_schema", "regex", "ebnf", "structural_tag"):
        bad(bool(getattr(sp, g, None)), g, "a grammar masks the logits before sampling", "drop it; constrain outside the sampler")
    bad(getattr(sp, "min_new_tokens", 0) > 0, f"min_new_tokens={sp.min_new_tokens}", "masks EOS " + changes[6:],
        "send 0 and filter short samples yourself")
    custom = getattr(sp, "custom_params", None) or {}
    bad(bool(getattr(obj, "custom_logit_processor", None)), "custom_logit_processor", changes, "drop it")
    bad("thinking_budget" in custom or getattr(obj, "max_thinking_tokens", None) is not None,
        "max_thinking_tokens", "the thinking budget is a logit processor", "drop it")
    bad(bool(getattr(obj, "return_routed_experts", False)), "return_routed_experts",
        "the contract's router bypasses SGLang's capture site, so the ids would be missing", "drop it")
    bad(bool(getattr(obj, "return_sampling_mask", False)), "return_sampling_mask",
        "not produced by the contract's sampler", "drop it; top_k/top_p/min_p are applied and reported via log-probs")
    return out


def _check(result, tm, obj, *args, **kwargs) -> None:
    from true_on_policy import env
    from true_on_policy.contract import get_contract

    if not env.ENABLED.is_true():
        return
    sp = getattr(result, "sampling_params", None)
    if sp is None or not hasattr(sp, "temperature"):
        return  # embedding requests: no sampling
    found = problems(sp, obj)
    if found:
        from true_on_policy import DEFAULT_CONTRACT

        name = get_contract(env.CONTRACT.get() or DEFAULT_CONTRACT).name
        raise RequestContractError(f"true-on-policy contract {name} refuses this request ({len(found)} problem(s)); "
                                   "nothing was scheduled:\n  - " + "\n  - ".join(found))


def apply(policy) -> PatchRecord:
    rep = wrap(CREATE, after(_check))
    return PatchRecord.of("request_contract", [rep],
                       ["requests whose resolved sampling parameters change the logits before the sampler "
                        "(penalties, logit_bias, grammars, min_new_tokens, custom processors) or ask for "
                        "routed experts / sampling masks are refused before scheduling (HTTP 400)"])
