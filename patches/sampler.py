"""Logits and sampler seam (sglang/srt/layers/logits_processor.py, sglang/srt/layers/sampler.py).

Under an rl target SGLang computes lm_head as a bf16 matmul and returns a bf16
``log_softmax(bf16(logits / T))`` (fp32 for all-greedy batches: a batch-composition
dependence). The contract: logits = fp32 accumulator of the batch-invariant GEMM (never rounded
to bf16), and the returned ``output_token_logprobs`` = fp32 ``log_softmax(logits / T)`` at the
sampled token over the full vocabulary (``kernels/logprobs``), for greedy (T = 1) and sampled
requests alike. The token choice stays SGLang's seeded sampler; only the reported log-prob is
replaced, from a copy of the logits taken before the sampler's in-place scaling.
"""

from __future__ import annotations

from true_on_policy.manifest import PatchRecord
from true_on_policy.patching import PatchError, replacing, wrap

LM_HEAD = "sglang.srt.layers.logits_processor.LogitsProcessor._compute_lm_head"
SAMPLER = "sglang.srt.layers.sampler.Sampler.forward"


def tpo_lm_head(self, hidden_states, lm_head, embedding_bias=None):
    import torch
    from true_on_policy.kernels.matmul import matmul

    if embedding_bias is not None or getattr(self, "logit_scale", None) is not None:
        raise PatchError(f"{LM_HEAD}: embedding bias / logit scale are not in the contract")
    if not hasattr(lm_head, "weight") or hasattr(lm_head, "set_lora"):
        raise PatchError(f"{LM_HEAD}: only a plain bf16 lm_head is in the contract")
    x = hidden_states.to(lm_head.weight.dtype).contiguous()
    return matmul(x, lm_head.weight, out_dtype=torch.float32, role="lm_head")


def _make_sampler(original):
    def tpo_sampler_forward(self, logits_output, sampling_info, return_logprob, top_logprobs_nums,
                            token_ids_logprobs, positions):
        import torch
        from true_on_policy.kernels.logprobs import token_logprobs

        logits = logits_output.next_token_logits
        kept = logits.clone() if return_logprob else None  # the sampler scales logits in place
        ids = original(self, logits_output, sampling_info, return_logprob, top_logprobs_nums,
                       token_ids_logprobs, positions)
        if return_logprob:
            if sampling_info.is_all_greedy or sampling_info.temperatures is None:
                temps = torch.ones(kept.shape[0], dtype=torch.float32, device=kept.device)
            else:
                temps = sampling_info.temperatures.reshape(-1).to(torch.float32)
            logits_output.next_token_logprobs = token_logprobs(kept, ids, temps, validate=False)
        return ids

    return tpo_sampler_forward


def apply(policy) -> PatchRecord:
    reps = [wrap(LM_HEAD, replacing(tpo_lm_head)), wrap(SAMPLER, _make_sampler)]
    return PatchRecord.of("sampler", reps,
                       ["lm_head: fp32 logits from kernels.matmul",
                        "output_token_logprobs: kernels.logprobs fp32 log_softmax(logits / T) at the sampled token"])
