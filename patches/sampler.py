"""Logits and sampler seam (sglang/srt/layers/logits_processor.py, sglang/srt/layers/sampler.py,
sglang/srt/layers/logprob_processor.py, and the batch's sampling parameters in
sglang/srt/sampling/sampling_batch_info.py).

Under an rl target SGLang computes lm_head as a bf16 matmul, *samples* from
``log_softmax(bf16(bf16(logits) / T))`` and reports stock values for top-logprobs, token-id
logprobs and input logprobs. The contract:

- logits = the fp32 accumulator of the batch-invariant GEMM (never rounded to bf16);
- each token is drawn from, and reported with, the fp32 ``log_softmax(logits / T)`` of
  ``kernels/logprobs`` (``kernels/sampling.sample``: Gumbel-max with seeded per-position noise;
  top_k / top_p / min_p truncate and renormalise that same distribution; greedy = argmax of the
  fp32 logits). One statistics pass, one draw pass, no second log-softmax;
- ``output_top_logprobs`` and ``output_token_ids_logprobs`` are read from the distribution the
  token was drawn from (so the sampled token's entry equals its ``output_token_logprobs``);
- ``input_token_logprobs`` / ``input_top_logprobs`` / ``input_token_ids_logprobs`` and the
  prefill-only scoring path are the same kernel at T = 1 (SGLang's input log-probs are
  untempered), i.e. the trainer's ``token_logprobs(..., temperature=1.0)``.

The truncation's host bound: SamplingBatchInfo's hooks for extensions (``adjusted_from_schedule_batch``,
``adjusted_merge_batch``) and ``copy_for_forward`` carry, beside SGLang's GPU tensors, one host int
(``requests_top_k_bound``): at least the top_k of every request of the batch that truncates (the
vocabulary when one truncates by top_p or min_p alone). A filter keeps it (still a bound), a merge
takes the larger. With it ``sample`` truncates from torch.topk's cut instead of sorting the vocabulary, the
same bits (``kernels/sampling._top_cut``; ``truncate``'s top-k form where top log-probs are asked), reading
nothing back from the GPU.

Parameters that change the logits before the sampler (penalties, logit bias, grammars, custom
processors, min_new_tokens) are refused per request before scheduling
(``patches/request_contract.py``); the sampler raises if one still arrives.
"""

from __future__ import annotations

from true_on_policy.manifest import PatchRecord
from true_on_policy.patching import PatchError, after, replacing, wrap

LM_HEAD = "sglang.srt.layers.logits_processor.LogitsProcessor._compute_lm_head"
SAMPLER = "sglang.srt.layers.sampler.Sampler.forward"
LOGPROBS_ONLY = "sglang.srt.layers.sampler.Sampler.compute_logprobs_only"
INPUT_LOGPROBS = "sglang.srt.layers.logprob_processor.InputLogprobProcessor._forward_by_chunk"
_INFO = "sglang.srt.sampling.sampling_batch_info.SamplingBatchInfo"
INFO_FROM_BATCH, INFO_MERGE, INFO_COPY = (f"{_INFO}.adjusted_from_schedule_batch", f"{_INFO}.adjusted_merge_batch",
                                          f"{_INFO}.copy_for_forward")
BOUND = "tpo_top_k_bound"  # the SamplingBatchInfo attribute that holds requests_top_k_bound


def requests_top_k_bound(params, vocab: int) -> int:
    """At least the top_k of every request in ``params`` (SGLang's SamplingParams) that truncates
    under ``kernels/sampling.truncation_params``: top_k <= 0 or > vocab keeps the vocabulary, top_k 1
    is greedy and never truncates; a request truncates with 1 < top_k < vocab, top_p < 1 or min_p > 0
    (judged before the fp32 rounding of top_p: that can only add a request). 0: none truncates."""
    out = 0
    for sp in params:
        k = vocab if sp.top_k <= 0 or sp.top_k > vocab else int(sp.top_k)
        if k != 1 and (k < vocab or sp.top_p < 1.0 or sp.min_p > 0.0):
            out = max(out, k)
    return out


def _bound_from_batch(_, info, batch, vocab_size):
    setattr(info, BOUND, requests_top_k_bound([r.sampling_params for r in batch.reqs], vocab_size))


def _bound_merge(_, info, other):
    a, b = getattr(info, BOUND, None), getattr(other, BOUND, None)
    setattr(info, BOUND, None if a is None or b is None else max(a, b))


def _bound_copy(copy, info):
    setattr(copy, BOUND, getattr(info, BOUND, None))


def tpo_lm_head(self, hidden_states, lm_head, embedding_bias=None):
    import torch
    from true_on_policy.kernels.matmul import matmul

    if embedding_bias is not None or getattr(self, "logit_scale", None) is not None:
        raise PatchError(f"{LM_HEAD}: embedding bias / logit scale are not in the contract")
    if not hasattr(lm_head, "weight") or hasattr(lm_head, "set_lora"):
        raise PatchError(f"{LM_HEAD}: only a plain bf16 lm_head is in the contract")
    x = hidden_states.to(lm_head.weight.dtype).contiguous()
    return matmul(x, lm_head.weight, out_dtype=torch.float32, role="lm_head")


def _check_batch(sampling_info) -> None:
    bad = [name for name, on in (
        ("custom logit processor", sampling_info.has_custom_logit_processor),
        ("grammar", bool(getattr(sampling_info, "grammars", None))),
        ("logit bias", getattr(sampling_info, "logit_bias", None) is not None),
        ("sampling seed (deterministic inference is off)", sampling_info.sampling_seed is None),
    ) if on]
    if bad:
        raise PatchError(f"{SAMPLER}: off-contract batch ({', '.join(bad)}); the request contract should have "
                         "refused it before scheduling")


def truncates(sampling_info) -> bool:
    """Whether the batch may hold a truncating row, from SGLang's host flags only (a decode step
    reads nothing back from the GPU to decide): top_p < 1, min_p > 0, or a top_k in a batch that is
    not all greedy (greedy rows carry top_k = 1 and never truncate). The flags are conservative
    after a filter (SGLang keeps them), which costs a truncation pass, never a bit: an untruncated
    row gives the same token and log-prob on either path."""
    return bool(sampling_info.need_top_p_sampling or sampling_info.need_min_p_sampling
                or (sampling_info.need_top_k_sampling and not sampling_info.is_all_greedy))


def tpo_sampler_forward(self, logits_output, sampling_info, return_logprob, top_logprobs_nums,
                        token_ids_logprobs, positions):
    import torch
    from true_on_policy.kernels.sampling import sample

    _check_batch(sampling_info)
    logits = logits_output.next_token_logits
    top_k = sampling_info.top_ks if sampling_info.need_top_k_sampling else None
    truncating = truncates(sampling_info)
    bound = getattr(sampling_info, BOUND, None)  # None (a batch SGLang built another way): the sort
    want_top = return_logprob and (any(x > 0 for x in top_logprobs_nums or ())
                                   or any(x is not None for x in token_ids_logprobs or ()))
    ids, lp, dist = sample(
        logits, sampling_info.temperatures.reshape(-1), sampling_info.sampling_seed, positions,
        top_k=top_k,
        top_p=sampling_info.top_ps if truncating else None,
        min_p=sampling_info.min_ps if truncating and sampling_info.need_min_p_sampling else None,
        need_dist=want_top, truncating=truncating, bound=bound if truncating else None)
    ids = ids.to(torch.int32)
    if return_logprob:
        if want_top:
            result = self.output_logprob_processor.compute_logprobs(dist, top_logprobs_nums, token_ids_logprobs, ids)
            result.token_logprobs = lp  # the same values as dist at ids (dist was clamped to finfo.min in place)
            result.write_output_to(logits_output)
        else:
            logits_output.next_token_logprobs = lp
    self._sync_token_ids_across_tp(ids, sampling_info)
    return ids


def tpo_compute_logprobs_only(self, logits_output, sampling_info, top_logprobs_nums, token_ids_logprobs):
    """Prefill-only scoring: top / token-id log-probs from the contract's kernel at T = 1."""
    from sglang.srt.layers.logprob_processor import (
        LogprobResult,
        get_token_ids_logprobs_batch_optimized,
        get_top_logprobs,
    )
    from true_on_policy.kernels.sampling import log_softmax_rows

    logits = logits_output.next_token_logits
    needs_ids = any(t is not None and len(t) > 0 for t in token_ids_logprobs)
    needs_top = any(x > 0 for x in top_logprobs_nums)
    if logits is None or not (needs_ids or needs_top):
        return
    _check_batch(sampling_info)
    logprobs = log_softmax_rows(logits, 1.0)
    result = LogprobResult()
    if needs_top:
        result.top_logprobs_val, result.top_logprobs_idx = get_top_logprobs(logprobs, top_logprobs_nums,
                                                                            no_copy_to_cpu=True)
    if needs_ids:
        result.token_ids_logprobs_val, result.token_ids_logprobs_idx = get_token_ids_logprobs_batch_optimized(
            logprobs, token_ids_logprobs)
    result.write_output_to(logits_output)


def tpo_input_logprobs(self, pruned_states, sample_indices, input_logprob_indices, token_to_seq_idx, lm_head,
                       get_logits_fn, logits_metadata, chunk_size):
    """SGLang's chunked input log-prob loop with the contract's log-softmax (T = 1) in place of
    ``torch.log_softmax``; chunking changes no bit (the kernel is row-independent)."""
    import torch
    from sglang.srt.layers.logprob_processor import (
        LogprobResult,
        get_token_ids_logprobs_chunk,
        get_top_logprobs_chunk,
    )
    from true_on_policy.kernels.sampling import log_softmax_rows

    total = pruned_states.shape[0]
    n_chunks = (total + chunk_size - 1) // chunk_size
    want_top, want_ids = logits_metadata.extend_return_top_logprob, logits_metadata.extend_token_ids_logprob
    top_val, top_idx = ([], []) if want_top else (None, None)
    ids_val, ids_idx = ([], []) if want_ids else (None, None)
    split_top = split_ids = 0
    token_lps, sampled = [], None
    for i in range(n_chunks):
        start, end = i * chunk_size, min((i + 1) * chunk_size, total)
        in_chunk = (input_logprob_indices >= start) & (input_logprob_indices < end)
        rows = input_logprob_indices[in_chunk] - start
        where = torch.nonzero(in_chunk, as_tuple=True)[0]
        logits = get_logits_fn(pruned_states[start:end], lm_head, logits_metadata, use_logits_buffer=n_chunks == 1)
        if sampled is None:
            sampled = torch.empty((sample_indices.shape[0], logits.shape[1]), dtype=logits.dtype, device=logits.device)
        mine = (sample_indices >= start) & (sample_indices < end)
        if mine.any():
            sampled[mine] = logits[sample_indices[mine] - start]
        lp = log_softmax_rows(logits[rows], 1.0)
        del logits
        seqs = slice(token_to_seq_idx[start], token_to_seq_idx[end - 1] + 1)
        pruned = logits_metadata.extend_logprob_pruned_lens_cpu[seqs]
        if want_top:
            split_top = get_top_logprobs_chunk(lp, logits_metadata.top_logprobs_nums[seqs], pruned, top_val, top_idx,
                                               split_top)
        if want_ids:
            split_ids = get_token_ids_logprobs_chunk(lp, logits_metadata.token_ids_logprobs[seqs], pruned, ids_val,
                                                     ids_idx, split_ids)
        tok = logits_metadata.extend_input_logprob_token_ids_gpu[where]
        token_lps.append(lp[torch.arange(lp.shape[0], device=lp.device), tok])
    return LogprobResult(token_logprobs=torch.cat(token_lps), top_logprobs_val=top_val, top_logprobs_idx=top_idx,
                         token_ids_logprobs_val=ids_val, token_ids_logprobs_idx=ids_idx), sampled


def apply(policy) -> PatchRecord:
    reps = [wrap(LM_HEAD, replacing(tpo_lm_head)), wrap(SAMPLER, replacing(tpo_sampler_forward)),
            wrap(LOGPROBS_ONLY, replacing(tpo_compute_logprobs_only)),
            wrap(INPUT_LOGPROBS, replacing(tpo_input_logprobs)),
            wrap(INFO_FROM_BATCH, after(_bound_from_batch)), wrap(INFO_MERGE, after(_bound_merge)),
            wrap(INFO_COPY, after(_bound_copy))]
    return PatchRecord.of("sampler", reps,
                       ["lm_head: fp32 logits from kernels.matmul",
                        "tokens drawn by kernels.sampling.sample from the fp32 log_softmax(logits / T) they are "
                        "reported with (Gumbel-max, seeded per position; top_k/top_p/min_p on that distribution)",
                        "top / token-id log-probs from the drawn distribution; input log-probs at T = 1 from the "
                        "same kernel"])
