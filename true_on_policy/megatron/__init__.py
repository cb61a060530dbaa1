"""Megatron-core trainer side: Qwen3-MoE on megatron-core's local layer spec, its
forward on the contract's kernels, at TP / expert-TP / EP / sequence parallel / pipeline parallel.

    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep)
    from true_on_policy import megatron as tpo_megatron
    model = tpo_megatron.build_model(hf_config, sequence_parallel=sp)   # megatron-core GPTModel
    tpo_megatron.load_hf(model, hf_state_dict)                         # this rank's shards
    tpo_megatron.patch_megatron_model(model)                           # our forward
    lp = tpo_megatron.token_logprobs(model, input_ids, mask, temperature=0.7)
    tpo_megatron.check_rollout(engine, model)                          # the fingerprint handshake
    engine.update_weights_from_tensor(tpo_megatron.sglang_named_tensors(model))

Needs the optional extra ``megatron`` (``pip install -e '.[megatron]'``). Files: ``config``
(builder, refusals), ``comm`` (groups, exact collectives with their backward), ``ops`` (the
contract's ops per provider, sharded MoE), ``forward`` (the model forward, ``token_logprobs``,
``check_rollout``), ``pipeline`` (stage boundary, log-probs broadcast), ``convert`` (HF <-> Megatron
state dicts), ``export`` (Megatron -> SGLang).
Built and CPU-tested (tests/cpu/test_megatron.py); not yet run on GPUs.
"""

from true_on_policy.megatron.config import MegatronLayoutError, build_model, hf_fields, padded_vocab
from true_on_policy.megatron.convert import Rank, load_hf, to_hf, to_megatron
from true_on_policy.megatron.export import hf_state_dict, sglang_named_tensors
from true_on_policy.megatron.forward import (
                                             check_rollout,
                                             finalize_grads,
                                             patch_megatron_model,
                                             token_logprobs,
                                             unpatch_megatron_model,
)

__all__ = ["MegatronLayoutError", "Rank", "build_model", "check_rollout", "finalize_grads", "hf_fields", "hf_state_dict", "load_hf",
           "padded_vocab", "patch_megatron_model", "sglang_named_tensors", "to_hf", "to_megatron", "token_logprobs",
           "unpatch_megatron_model"]
