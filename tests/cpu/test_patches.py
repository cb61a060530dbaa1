"""Patch mechanics against the real sglang 0.5.17: where the name is looked up, idempotent,
reversible, loud on a missing symbol; manifest lists every replacement."""

import types

import pytest
from helpers import run_py

from true_on_policy import patching
from true_on_policy.patching import PatchError


def test_wrap_undo_idempotent_and_propagated():
    code = """
import sglang.srt.distributed.bootstrap as b
import types, sys
consumer = types.ModuleType('consumer_imported_before'); sys.modules['consumer_imported_before'] = consumer
consumer.f = b._set_all_reduce_flags          # a `from bootstrap import _set_all_reduce_flags` binding
keep = {'orig': b._set_all_reduce_flags}   # not a module global: propagation rewrites those
orig = keep['orig']
from true_on_policy import patching
r1 = patching.wrap('sglang.srt.distributed.bootstrap._set_all_reduce_flags', patching.after(lambda *a, **k: None))
r2 = patching.wrap('sglang.srt.distributed.bootstrap._set_all_reduce_flags', patching.after(lambda *a, **k: None))
orig = keep['orig']
assert r1 is r2 and b._set_all_reduce_flags is r1.new and r1.new.__wrapped__ is orig
assert consumer.f is r1.new, 'consumer imported before apply must see the replacement'
assert patching.undo('sglang.srt.distributed.bootstrap._set_all_reduce_flags')
assert b._set_all_reduce_flags is orig and consumer.f is orig
assert not patching.undo('sglang.srt.distributed.bootstrap._set_all_reduce_flags')
print('ok')
"""
    r = run_py(code)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_apply_all_and_undo_all_restore_everything():
    code = """
from true_on_policy import patches, patching
from true_on_policy.contract.policy import RuntimePolicy
from true_on_policy.contract import get_contract
import sglang.srt.models.qwen3_moe as q, sglang.srt.managers.tp_worker as w
orig = (q.Qwen3MoeAttention.__init__, w.TpModelWorker.__init__)  # a tuple: not rewritten
m = patches.apply_all(RuntimePolicy(get_contract('qwen3_moe_true_on_policy_v1'), 'scheduler'))
lines = [l for p in m.patches for l in p.replacements]
assert len(lines) == len(patching.applied()) == 39, lines
assert [p.patch for p in m.patches] == ['tp_worker', 'weights', 'weight_updates', 'layernorm', 'linear', 'communicator', 'rope',
                                        'attention_backend', 'sampler', 'qwen3_moe', 'pipeline', 'cuda_graph',
                                        'scheduler_guard']
assert all(': ' in l and ' -> ' in l for l in lines)
assert patches.apply_all(RuntimePolicy(get_contract('qwen3_moe_true_on_policy_v1'), 'scheduler')) is m
assert q.Qwen3MoeAttention.__init__ is not orig[0]
targets = sorted(l.split(':')[0] for l in lines)
originals = {t: patching.applied()[t].original for t in targets}
assert all(patching.resolve(t)[2] is patching.applied()[t].new for t in targets)  # installed where looked up
assert sorted(patches.undo_all()) == targets
assert (q.Qwen3MoeAttention.__init__, w.TpModelWorker.__init__) == orig
assert all(patching.resolve(t)[2] is originals[t] for t in targets), 'every symbol restored'
print('ok')
"""
    r = run_py(code)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_manifest_tells_patched_from_stock():
    """Every record names the original (its own module and qualname) and the replacement (ours,
    never the original's name copied over), and whether the replacement is installed, checked by
    identity when the record is checked: the same records after undo_all read NOT PATCHED."""
    code = """
import json
from true_on_policy import patches, patching
from true_on_policy.contract import get_contract
from true_on_policy.contract.policy import RuntimePolicy
m = patches.apply_all(RuntimePolicy(get_contract('qwen3_moe_true_on_policy_v1'), 'scheduler'))
patched = json.loads(json.dumps(m.to_dict()['patches']))
syms = [s for p in patched for s in p['symbols']]
assert len(syms) == 39 and all(s['installed'] for s in syms), syms
for s in syms:
    assert s['original'] != s['replacement'] and s['replacement'].startswith('true_on_policy.patches.'), s
    assert not s['original'].startswith('true_on_policy'), s
    assert s['kind'] in ('replace', 'before', 'after', 'wrap') and 'found' not in s, s
    assert patching.resolve(s['target'])[2].__qualname__ != patching.applied()[s['target']].original.__qualname__
by_target = {s['target']: s for s in syms}
assert by_target['sglang.srt.layers.sampler.Sampler.forward']['replacement'] == \\
    'true_on_policy.patches.sampler.tpo_sampler_forward'
assert by_target['sglang.srt.layers.layernorm.RMSNorm.forward_cuda'] == {
    'target': 'sglang.srt.layers.layernorm.RMSNorm.forward_cuda', 'kind': 'replace', 'installed': True,
    'original': 'sglang.srt.layers.layernorm.RMSNorm.forward_cuda',
    'replacement': 'true_on_policy.patches.layernorm.tpo_rmsnorm'}
lines = [l for p in patched for l in p['replacements']]
assert all(' -> true_on_policy.patches.' in l and 'NOT PATCHED' not in l for l in lines), lines
records = m.patches
patches.undo_all()
stock = [r.check().symbols for r in records]
stock_syms = [s for p in stock for s in p]
assert [s['target'] for s in stock_syms] == [s['target'] for s in syms]
assert not any(s['installed'] for s in stock_syms), stock_syms
assert all(s['found'] == s['original'] == by_target[s['target']]['original'] for s in stock_syms)
stock_lines = [l for r in records for l in r.replacements]
assert all('NOT PATCHED' in l for l in stock_lines) and not set(stock_lines) & set(lines)
print('ok')
"""
    r = run_py(code)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


@pytest.mark.parametrize("target, needle", [
    ("sglang.srt.models.qwen3_moe.Qwen3MoeAttention.forward_renamed", "no attribute 'forward_renamed'"),
    ("sglang.srt.models.qwen3_moe_gone.Qwen3MoeAttention.__init__", "cannot be imported"),
])
def test_missing_symbol_raises_naming_it(target, needle):
    with pytest.raises(PatchError) as e:
        patching.wrap(target, patching.after(lambda *a, **k: None))
    msg = str(e.value)
    assert target in msg and needle in msg and "sglang==0.5.17" in msg


def test_attention_patch_refuses_an_instance_without_the_flag_or_our_rope():
    from true_on_policy.patches import qwen3_moe

    class Bare:
        pass

    with pytest.raises(PatchError, match="compatible_with_fused_kv_buffer"):
        qwen3_moe._attention_built(None, Bare())
    ok = Bare()
    ok.compatible_with_fused_kv_buffer = ok.use_fused_qk_norm_rope = True
    with pytest.raises(PatchError, match="not bound to the contract's RoPE"):
        qwen3_moe._attention_built(None, ok)  # stock RoPE: the patch came too late

    def ours(*a):
        pass

    ours.__true_on_policy_patch__ = "x"

    from sglang.srt.layers.rotary_embedding.base import RotaryEmbedding

    rope = RotaryEmbedding.__new__(RotaryEmbedding)  # the fields SGLang's constructor sets, no CUDA cache
    object.__setattr__(rope, "__dict__", {"head_size": 64, "rotary_dim": 64, "is_neox_style": True, "base": 1e6})
    rope._forward_method = ours.__get__(rope)
    ok.rotary_emb = rope
    qwen3_moe._attention_built(None, ok)
    assert ok.compatible_with_fused_kv_buffer is True and ok.use_fused_qk_norm_rope is False  # the write: our RoPE
    ok.config = types.SimpleNamespace(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                                                       "original_max_position_embeddings": 64})
    with pytest.raises(PatchError, match="would compute different models"):  # a yarn config built as plain RoPE
        qwen3_moe._attention_built(None, ok)
    ok.config.rope_parameters = {"rope_type": "default", "rope_theta": 1e6}
    qwen3_moe._attention_built(None, ok)


def test_communicator_all_reduce_passes_only_tree_reduced_tensors():
    """Installed where the communicator looks the names up: the attention-TP all-reduce returns
    a tensor marked by the row-parallel linear unchanged and refuses any other; the fused and
    quantised all-reduces refuse whatever reaches them. ``tensor_model_parallel_all_reduce``
    stays SGLang's: a wrap replaces a function wherever it is bound, and the vocab-parallel
    embedding's all-reduce (exact: one non-zero per element) goes through it."""
    code = """
import torch
import sglang.srt.layers.communicator as c
import sglang.srt.layers.vocab_parallel_embedding as vpe
stock_tp_all_reduce = vpe.tensor_model_parallel_all_reduce
from true_on_policy import patches
from true_on_policy.contract import get_contract
from true_on_policy.patches.linear import REDUCED
from true_on_policy.patching import PatchError
from true_on_policy.contract.policy import RuntimePolicy
patches.apply_all(RuntimePolicy(get_contract('qwen3_moe_true_on_policy_v1'), 'scheduler'))
y = torch.ones(2, 3)
setattr(y, REDUCED, True)
assert c.attention_tensor_model_parallel_all_reduce(y) is y
assert vpe.tensor_model_parallel_all_reduce is stock_tp_all_reduce is c.tensor_model_parallel_all_reduce
for f in (c.attention_tensor_model_parallel_all_reduce, c.attention_tensor_model_parallel_quant_all_reduce,
          c.moe_tensor_model_parallel_all_reduce):
    try:
        f(torch.ones(2, 3))
    except PatchError as e:
        assert 'not in the contract' in str(e), e
    else:
        raise AssertionError(f'{f} accepted an unreduced tensor')
patches.undo_all()
print('ok')
"""
    r = run_py(code)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_main_process_patches_installed_where_looked_up_and_undone():
    """The launching process's seams (per-request contract, seeds on the real TokenizerManager; one
    weight-update payload per (pp, tp) rank on the real Engine)."""
    code = """
from true_on_policy import patching, plugin
from true_on_policy.contract.policy import RuntimePolicy
from true_on_policy.contract import get_contract
from sglang.srt.managers.tokenizer_manager import TokenizerManager as TM
from sglang.srt.entrypoints.engine import Engine
keep = {'serialize': Engine.__dict__['_serialize_tensors_per_rank']}  # not a module global: wrap rewrites those
from sglang.srt.managers.tokenizer_control_mixin import TokenizerControlMixin as MIX
before = {n: TM.__dict__[n] for n in ('generate_request', '_create_tokenized_object', '_send_one_request',
                                       '_send_batch_request', '_wait_one_response', 'update_weights_from_disk')}
mix = {n: MIX.__dict__[n] for n in ('update_weights_from_tensor', 'update_weights_from_distributed',
                                     'update_weights_from_ipc')}
records = plugin.install_main_process(RuntimePolicy(get_contract('qwen3_moe_true_on_policy_v1'), 'launcher'))
assert [r.patch for r in records] == ['request_contract', 'seeds', 'weights_engine', 'weight_updates_main']
assert all(MIX.__dict__[n].__wrapped__ is f for n, f in mix.items())
assert Engine.__dict__['_serialize_tensors_per_rank'].__wrapped__ is keep['serialize']
assert all(TM.__dict__[n] is not f and TM.__dict__[n].__wrapped__ is f for n, f in before.items())
import inspect
assert inspect.isasyncgenfunction(TM.__dict__['_wait_one_response'])
assert inspect.isasyncgenfunction(TM.__dict__['generate_request'])
assert all(inspect.iscoroutinefunction(MIX.__dict__[n]) for n in mix)
assert plugin.install_main_process(RuntimePolicy(get_contract('qwen3_moe_true_on_policy_v1'), 'launcher'))
for t in list(patching.applied()):
    patching.undo(t)
assert all(TM.__dict__[n] is f for n, f in before.items())
assert all(MIX.__dict__[n] is f for n, f in mix.items())
assert Engine.__dict__['_serialize_tensors_per_rank'] is keep['serialize']
print('ok')
"""
    r = run_py(code)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


@pytest.mark.parametrize("lens,pre,bound", [([3, 40], [100, 5], 103), ([7], [0], 7), (None, None, 262144),
                                             ([3, 40], None, 262144)])
def test_an_extend_bounds_its_keys_by_its_own_sequences_else_by_the_context(monkeypatch, lens, pre, bound):
    """The extend passes the kernel its longest sequence (prefix + new tokens, from SGLang's host lists), which
    sizes a split's state; without the lists, req_to_token's width. Computed once a batch, not once a layer."""
    import torch
    from true_on_policy.kernels import attention as A
    from true_on_policy.patches import attention_backend as ab

    seen = []
    monkeypatch.setattr(A, "attention", lambda *a, **kw: seen.append((a[7], kw["max_kv_len"])) or kw["out"])
    layer = types.SimpleNamespace(is_cross_attention=False, logit_cap=0, sliding_window_size=None, k_scale=None,
                                  qk_head_dim=128, v_head_dim=128, tp_q_head_num=8, tp_k_head_num=2, layer_id=0,
                                  scaling=None)
    kv = torch.zeros(16, 2 * 128)
    pool = types.SimpleNamespace(get_key_buffer=lambda i: kv, get_value_buffer=lambda i: kv)
    backend = types.SimpleNamespace(token_to_kv_pool=pool, req_to_token=torch.zeros(2, 262144, dtype=torch.int32),
                                    _translate_kv_loc=None)
    n = torch.tensor(lens or [3, 40])
    batch = types.SimpleNamespace(extend_seq_lens=n, extend_prefix_lens=torch.tensor(pre or [0, 0]),
                                  extend_seq_lens_cpu=lens, extend_prefix_lens_cpu=pre, extend_start_loc=n * 0,
                                  req_pool_indices=torch.tensor([0, 1]))
    q = torch.zeros(int(n.sum()), 8 * 128)
    for _ in range(2):
        ab.tpo_extend(backend, q, torch.empty_like(q), layer, batch, True, 0.0, None)
    assert seen == [(max(lens or [40]), bound)] * 2


def test_attention_backend_holds_its_split_kv_scratch_at_one_split():
    """Deterministic mode sizes the Triton backend's split-KV scratch by the context (262,144 tokens: 1,024 splits,
    12 GiB of decode-graph fp32 at 96 heads and 256 tokens); under the contract, whose decode never runs that
    kernel, the backend SGLang builds holds one split. SGLang's constructor is stood in for by one that sets what it
    sets in deterministic mode (a backend needs a model runner), and the patch wraps that."""
    code = """
from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
from true_on_policy import patching
from true_on_policy.patches import attention_backend

def deterministic_init(self, model_runner=None):
    self.num_head, self.v_head_dim, self.swa_v_head_dim, self.device = 96, 128, None, 'cpu'
    self.max_context_len, self.split_tile_size = 262144, 256
    self.max_kv_splits = -(-self.max_context_len // self.split_tile_size)
    self.is_draft_runner = self.skip_prefill = False
    self.num_draft_tokens, self.sliding_window_size, self.use_sliding_window_kv_pool = None, None, False
    self._translate_kv_loc = None

TritonAttnBackend.__init__ = deterministic_init
stock = TritonAttnBackend()
stock.init_cuda_graph_state(2, 2)
assert stock.max_kv_splits == 1024 and tuple(stock.cuda_graph_attn_logits.shape) == (2, 96, 1024, 128)
rec = attention_backend.apply(None)
assert any(s['target'] == attention_backend.INIT and s['installed'] and s['kind'] == 'after' for s in rec.symbols)
b = TritonAttnBackend()
b.init_cuda_graph_state(2, 2)
assert b.max_kv_splits == 1 and tuple(b.cuda_graph_attn_logits.shape) == (2, 96, 1, 128), b.cuda_graph_attn_logits.shape
assert tuple(b.cuda_graph_attn_lse.shape) == (2, 96, 1) and b.split_tile_size == 256
assert patching.undo(attention_backend.INIT) and TritonAttnBackend.__init__ is deterministic_init
print('ok')
"""
    r = run_py(code)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
