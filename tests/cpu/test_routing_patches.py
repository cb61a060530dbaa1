"""The rollout routing patches on the CPU, against the real sglang 0.5.17 classes: each patched
method computes the contract's op (reference kernels are not involved: these call the same
``kernels/`` functions under TRITON_INTERPRET=1), refuses what the contract excludes, and the
CUDA-graph hook refuses a capture before the patches. The GPU tier checks bits end to end."""

from helpers import run_py

CODE = r"""
import torch, types
from true_on_policy import patches
from true_on_policy.contract.policy import RuntimePolicy
from true_on_policy.contract import get_contract
from true_on_policy.patching import PatchError
from true_on_policy.patches import layernorm, linear, rope, sampler, cuda_graph, qwen3_moe
from true_on_policy.kernels.rmsnorm import rmsnorm_reference
from true_on_policy.kernels.rope import apply_rope_reference, cos_sin
from true_on_policy.kernels.matmul import matmul_reference
from true_on_policy.kernels.tree_reduce import row_linear_reference

# 1. a capture before the patches is refused
class Runner: capture_bs = [1, 2, 4]
try:
    cuda_graph._make_capture(lambda self: None)(Runner())
except PatchError as e:
    assert 'missing' in str(e)
else:
    raise AssertionError('capture before patches accepted')
patches.apply_all(RuntimePolicy(get_contract('qwen3_moe_true_on_policy_v1'), 'scheduler'))
from sglang.srt.layers.layernorm import RMSNorm
ours = RMSNorm.forward_cuda
RMSNorm.forward_cuda = ours.__wrapped__  # applied, then overwritten: not installed, by identity
try:
    cuda_graph._make_capture(lambda self: None)(Runner())
except PatchError as e:
    assert 'RMSNorm.forward_cuda' in str(e), e
else:
    raise AssertionError('capture with an overwritten patch accepted')
RMSNorm.forward_cuda = ours
cuda_graph._make_capture(lambda self: None)(Runner())
assert cuda_graph.CAPTURED['decode_batch_sizes'] == [1, 2, 4]
# the prefill runner's capture is guarded and recorded the same way (its token counts)
from sglang.srt.model_executor.runner.prefill_cuda_graph_runner import PrefillCudaGraphRunner
assert PrefillCudaGraphRunner.capture.__wrapped__ is not None  # installed by apply_all
class PrefillRunner: capture_num_tokens = [8, 4, 16]
cuda_graph._make_capture(lambda self: None, cuda_graph.PREFILL_CAPTURE)(PrefillRunner())
assert cuda_graph.CAPTURED['prefill_num_tokens'] == [4, 8, 16] and cuda_graph.CAPTURED['prefill_captured']
RMSNorm.forward_cuda = ours.__wrapped__
try:
    cuda_graph._make_capture(lambda self: None, cuda_graph.PREFILL_CAPTURE)(PrefillRunner())
except PatchError as e:
    assert 'RMSNorm.forward_cuda' in str(e), e
else:
    raise AssertionError('prefill capture with an overwritten patch accepted')
RMSNorm.forward_cuda = ours

g = torch.Generator().manual_seed(0)
# 2. RMSNorm: the class method is ours; residual and plain patterns; 3-D input keeps its shape
norm = types.SimpleNamespace(weight=(1 + 0.1 * torch.randn(64, generator=g)).bfloat16(), variance_epsilon=1e-6)
x, r = torch.randn(2, 5, 64, generator=g).bfloat16(), torch.randn(2, 5, 64, generator=g).bfloat16()
assert RMSNorm.forward_cuda.__wrapped__ is not None
out, res = RMSNorm.forward_cuda(norm, x, r)
ref, rres = rmsnorm_reference(x.view(-1, 64), norm.weight, 1e-6, r.view(-1, 64))
assert out.shape == x.shape and res.shape == r.shape  # (the interpreter truncates fp32 -> bf16: tolerances)
torch.testing.assert_close(res.view(-1, 64).float(), rres.float(), rtol=1e-2, atol=1e-2)
torch.testing.assert_close(out.view(-1, 64).float(), ref.float(), rtol=2e-2, atol=2e-2)
try:
    RMSNorm.forward_cuda(norm, x, r, post_residual_addition=r)
except PatchError:
    pass
else:
    raise AssertionError('post_residual_addition accepted')
# 3. linear: column layers plain GEMM, RowParallelLinear the 8-segment tree
from sglang.srt.layers.linear import RowParallelLinear
from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod
w = (torch.randn(32, 256, generator=g) * 0.05).bfloat16()
xa = torch.randn(7, 256, generator=g).bfloat16()
col = types.SimpleNamespace(weight=w)
torch.testing.assert_close(UnquantizedLinearMethod.apply(None, col, xa).float(), matmul_reference(xa, w).float(),
                           rtol=2e-2, atol=2e-2)
row = RowParallelLinear.__new__(RowParallelLinear)
object.__setattr__(row, '__dict__', {'weight': w, 'tp_size': 1})
torch.testing.assert_close(UnquantizedLinearMethod.apply(None, row, xa).float(), row_linear_reference(xa, w).float(),
                           rtol=2e-2, atol=2e-2)
row2 = RowParallelLinear.__new__(RowParallelLinear)  # TP=2 layer that would all-reduce its own output
object.__setattr__(row2, '__dict__', {'weight': w, 'tp_size': 2, 'tp_rank': 0, 'reduce_results': True})
try:
    UnquantizedLinearMethod.apply(None, row2, xa)
except PatchError as e:
    assert 'reduces its own output' in str(e), e
else:
    raise AssertionError('TP row layer with reduce_results accepted')
try:
    UnquantizedLinearMethod.apply(None, col, xa, bias=torch.zeros(32))
except PatchError:
    pass
else:
    raise AssertionError('bias accepted')
# 4. RoPE on q/k laid out [T, H*D]: default RoPE, YaRN from the instance's parameters, others refused
from sglang.srt.layers.rotary_embedding.base import RotaryEmbedding
from sglang.srt.layers.rotary_embedding.yarn import YaRNScalingRotaryEmbedding
from sglang.srt.layers.rotary_embedding.base import LinearScalingRotaryEmbedding
from true_on_policy.kernels.rope import Yarn
def instance(cls, **fields):  # the fields SGLang's constructors set (theirs build a CUDA cache)
    r = cls.__new__(cls)
    object.__setattr__(r, '__dict__', dict(head_size=64, rotary_dim=64, is_neox_style=True, base=1000000, **fields))
    return r
pos = torch.tensor([0, 5, 63, 64, 200])
q, k = torch.randn(5, 4 * 64, generator=g).bfloat16(), torch.randn(5, 2 * 64, generator=g).bfloat16()
yarn = dict(scaling_factor=8.0, max_position_embeddings=64, beta_fast=32, beta_slow=1, truncate=True,
            extrapolation_factor=1, mscale=1.2079441541679836)
for emb, scaling in ((instance(RotaryEmbedding), None),
                     (instance(YaRNScalingRotaryEmbedding, **yarn), Yarn(8.0, 64, 32.0, 1.0, True, 1.2079441541679836))):
    qo, ko = RotaryEmbedding.forward_native(emb, pos, q, k)
    c, s = cos_sin(pos, 64, 1e6, scaling)
    torch.testing.assert_close(qo.view(5, 4, 64).float(), apply_rope_reference(q.view(5, 4, 64), c, s).float(),
                               rtol=2e-2, atol=4e-2)
    torch.testing.assert_close(ko.view(5, 2, 64).float(), apply_rope_reference(k.view(5, 2, 64), c, s).float(),
                               rtol=2e-2, atol=4e-2)
assert not torch.equal(cos_sin(pos, 64, 1e6)[0], c)  # YaRN is not plain RoPE
# SGLang's fused K/V write (its FusedSetKVBufferArg: q, k, v split from one qkv row): the same q and k
# bits, the rotated k and the value rows stored at cache_loc, every other cache row untouched
from sglang.kernels.ops.attention.rope import FusedSetKVBufferArg
qkv = torch.randn(5, 8 * 64, generator=g).bfloat16()
qs, ks, vs = qkv.split([4 * 64, 2 * 64, 2 * 64], dim=-1)
kb, vb = torch.randn(12, 2 * 64, generator=g).bfloat16(), torch.randn(12, 2 * 64, generator=g).bfloat16()
kb0, vb0, loc = kb.clone(), vb.clone(), torch.tensor([7, 0, 11, 3, 4])
qo, ko = RotaryEmbedding.forward_native(emb, pos, qs.contiguous(), ks.contiguous())
qf, kf = RotaryEmbedding.forward_native(emb, pos, qs, ks, fused_set_kv_buffer_arg=FusedSetKVBufferArg(
    value=vs, k_buffer=kb, v_buffer=vb, cache_loc=loc))
assert torch.equal(qf, qo) and torch.equal(kf, ko) and qf.shape == qs.shape and kf.shape == ks.shape
assert torch.equal(kb[loc], ko) and torch.equal(vb[loc], vs)
rest = torch.ones(12, dtype=torch.bool)
rest[loc] = False
assert torch.equal(kb[rest], kb0[rest]) and torch.equal(vb[rest], vb0[rest])
try:
    RotaryEmbedding.forward_native(instance(LinearScalingRotaryEmbedding, scaling_factors=[2.0]), pos, q, k)
except PatchError as e:
    assert 'not in the contract' in str(e), e
else:
    raise AssertionError('linear-scaled RoPE ran as plain RoPE')
# 5. lm_head: fp32 logits
from sglang.srt.layers.logits_processor import LogitsProcessor
lm = types.SimpleNamespace(weight=(torch.randn(512, 64, generator=g) * 0.05).bfloat16())
lg = LogitsProcessor._compute_lm_head(types.SimpleNamespace(logit_scale=None), torch.randn(3, 64).bfloat16(), lm)
assert lg.dtype == torch.float32 and lg.shape == (3, 512)
print('routing-ok')
"""


def test_routing_patches_compute_the_contract_ops():
    # the stub runners have no model to time decode tiles on: the capture's tile choice has its own
    # test (test_attention_tiles), so this one keeps the fixed tile
    r = run_py(CODE, {"TRITON_INTERPRET": "1", "TRUE_ON_POLICY_DECODE_TILES": "fixed", "TRUE_ON_POLICY_TREE_TILE": "fixed"})
    assert r.returncode == 0 and "routing-ok" in r.stdout, r.stderr[-4000:]
