"""RMSNorm seam (sglang/srt/layers/layernorm.py): every call pattern through ``kernels/rmsnorm``.

SGLang's ``RMSNorm.forward_cuda`` has three call patterns -- no residual (q_norm, k_norm, the
first input norm), fused residual-add (every later input/post-attention norm, through the
``LayerCommunicator``) and the final norm -- and in deterministic mode sends the residual ones
to ``forward_native``, which normalises the *unrounded* fp32 sum. The contract rounds the sum
to bf16 first (Hugging Face order). We replace ``forward_cuda`` on the class before the model is
built; instances bind ``_forward_method`` at construction, so every norm (including the
communicator's own references, which are the same objects) runs the contract's kernel.
Can go when SGLang offers a norm with the HF rounding points in deterministic mode.
"""

from __future__ import annotations

from true_on_policy.manifest import PatchRecord
from true_on_policy.patching import PatchError, replacing, wrap

FORWARD_CUDA = "sglang.srt.layers.layernorm.RMSNorm.forward_cuda"


def tpo_rmsnorm(self, x, residual=None, post_residual_addition=None):
    from true_on_policy.kernels.rmsnorm import rmsnorm

    if post_residual_addition is not None or getattr(self, "variance_size_override", None) is not None:
        raise PatchError(f"{FORWARD_CUDA}: post_residual_addition / variance_size_override are not in the contract")
    if x.numel() == 0:
        return x if residual is None else (x, residual)
    h = x.shape[-1]
    x2 = x.reshape(-1, h).contiguous()
    if residual is None:
        return rmsnorm(x2, self.weight, self.variance_epsilon).view(x.shape)
    out, res = rmsnorm(x2, self.weight, self.variance_epsilon, residual.reshape(-1, h).contiguous())
    return out.view(x.shape), res.view(residual.shape)


def apply(policy) -> PatchRecord:
    rep = wrap(FORWARD_CUDA, replacing(tpo_rmsnorm))
    return PatchRecord.of("layernorm", [rep],
                          ["all RMSNorm call patterns: bf16 residual add, fp32 norm, bf16 weight multiply"])
