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

Refused too, before the request is normalised (``TokenizerManager.generate_request``), because a
scheduler cannot survive them (``true_on_policy.contract.requests``): token ids outside the
vocabulary, out-of-range ``top_logprobs_num`` / ``token_ids_logprob`` / ``logprob_start_len``,
seeds outside int64, ``n < 1``, NaN or infinite floats, fields of the wrong type, unknown sampling
parameters. Every problem of a request is listed in one message. While a failed weight update may
have left a mix of weights, every request is refused with HTTP 503 (``patches/weight_updates.py``).
"""

from __future__ import annotations

from true_on_policy.manifest import PatchRecord
from true_on_policy.patching import wrap

CREATE = "sglang.srt.managers.tokenizer_manager.TokenizerManager._create_tokenized_object"
GENERATE = "sglang.srt.managers.tokenizer_manager.TokenizerManager.generate_request"
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


def _limits(tm):
    from true_on_policy.contract.requests import Limits

    return Limits(vocab_size=int(tm.model_config.vocab_size), hidden_size=int(tm.model_config.hidden_size))


def _refuse(what: str, found: list[str]) -> None:
    from true_on_policy import DEFAULT_CONTRACT, env
    from true_on_policy.contract import get_contract

    name = get_contract(env.CONTRACT.get() or DEFAULT_CONTRACT).name
    raise RequestContractError(f"true-on-policy contract {name} refuses this request ({len(found)} {what}); "
                               "nothing was scheduled:\n  - " + "\n  - ".join(found))


def _is_generate(obj) -> bool:
    from sglang.srt.managers.io_struct import GenerateReqInput

    return isinstance(obj, GenerateReqInput)


def _make_generate(original):
    async def tpo_generate_request(self, obj, request=None):
        from true_on_policy import env

        if env.ENABLED.is_true() and _is_generate(obj):
            from true_on_policy.patches.weight_updates import check_serving

            from true_on_policy.contract.requests import request_problems

            check_serving(self)
            found = request_problems(obj, _limits(self))
            if found:
                _refuse("invalid field(s)", found)
        async for out in original(self, obj, request):
            yield out

    return tpo_generate_request


def _make_create(original):
    def tpo_create_tokenized_object(self, obj, input_text, input_ids, *args, **kwargs):
        from true_on_policy import env

        if not env.ENABLED.is_true() or not _is_generate(obj):
            return original(self, obj, input_text, input_ids, *args, **kwargs)
        from true_on_policy.contract.requests import sampling_problems, tokenized_problems

        limits, sent = _limits(self), obj.sampling_params or {}
        # the request's own fields (and token-id prompts) were checked in generate_request; here what
        # only this step knows: the server's defaults it takes, and the ids of a text prompt
        defaults = {k: v for k, v in (self.preferred_sampling_params or {}).items() if k not in sent}
        found = sampling_problems(defaults, limits, "--preferred-sampling-params") + tokenized_problems(
            input_ids, obj.logprob_start_len, limits.vocab_size, ids_checked=obj.input_ids is not None)
        if found:
            _refuse("invalid field(s)", found)
        result = original(self, obj, input_text, input_ids, *args, **kwargs)
        _check(result, self, obj)
        return result

    return tpo_create_tokenized_object


def _check(result, tm, obj, *args, **kwargs) -> None:
    from true_on_policy import env

    if not env.ENABLED.is_true():
        return
    sp = getattr(result, "sampling_params", None)
    if sp is None or not hasattr(sp, "temperature"):
        return  # embedding requests: no sampling
    found = problems(sp, obj)
    if found:
        _refuse("problem(s)", found)


def apply(policy) -> PatchRecord:
    reps = [wrap(GENERATE, _make_generate), wrap(CREATE, _make_create)]
    return PatchRecord.of("request_contract", reps,
                       ["requests whose resolved sampling parameters change the logits before the sampler "
                        "(penalties, logit_bias, grammars, min_new_tokens, custom processors) or ask for "
                        "routed experts / sampling masks are refused before scheduling (HTTP 400)",
                        "fields a scheduler could crash on (ids outside the vocabulary, bad seeds, NaN, wrong "
                        "types, out-of-range log-prob fields, n < 1) are refused before normalisation (HTTP 400)"])
