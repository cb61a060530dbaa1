"""YaRN RoPE on the CPU: the contract's inv_freq, attention factor and cos/sin are bitwise
transformers' (the trainer's reference) and close to a float64 evaluation; default RoPE is
unchanged; SGLang's YaRN instance reads as the config does (else refused at build); other rope
types refused; the patched trainer runs YaRN."""

import math
import types

import pytest
import torch
from transformers import Qwen3MoeConfig
from true_on_policy.kernels.rope import Yarn, cos_sin, inv_freq, rope_scaling, yarn_inv_freq

# Qwen3's documented long-context setting, small ones (a tiny model's prompts pass them), and the
# yarn262k checkpoint's (x8 from 32768 to 262144)
CONFIGS = [
    (128, 131072, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "rope_theta": 1e6}),
    (64, 128, {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64, "rope_theta": 1e6}),
    (64, 512, {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "rope_theta": 1e4,
               "truncate": False, "beta_fast": 16, "mscale": 1.0, "mscale_all_dim": 0.5}),
    (64, 262144, {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32768, "rope_theta": 1e6}),
]
POSITIONS = torch.tensor([0, 1, 63, 64, 65, 1000, 32767, 32768, 131071, 262143])


def _config(d, max_pos, rope):
    return Qwen3MoeConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=d,
                          max_position_embeddings=max_pos, rope_parameters=dict(rope))


@pytest.mark.parametrize("d,max_pos,rope", CONFIGS)
def test_yarn_is_bitwise_transformers(d, max_pos, rope):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRotaryEmbedding

    cfg = _config(d, max_pos, rope)
    hf_inv, hf_scale = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    y = rope_scaling(cfg.rope_parameters, cfg.max_position_embeddings)
    assert y.attention_factor == hf_scale  # the same float64
    mine = yarn_inv_freq(d, rope["rope_theta"], y)
    assert mine.dtype == torch.float32 and torch.equal(mine, hf_inv)
    hc, hs = Qwen3MoeRotaryEmbedding(cfg)(torch.zeros(1, dtype=torch.float32), POSITIONS[None])  # fp32 x: fp32 cos
    c, s = cos_sin(POSITIONS, d, rope["rope_theta"], y)
    assert torch.equal(c, hc[0, :, :d // 2]) and torch.equal(s, hs[0, :, :d // 2])
    assert torch.equal(hc[0, :, d // 2:], hc[0, :, :d // 2])  # HF's cat(freqs, freqs): our half is all of it


@pytest.mark.parametrize("d,max_pos,rope", CONFIGS)
def test_yarn_close_to_float64(d, max_pos, rope):
    y = rope_scaling(rope, max_pos)
    theta, half = rope["rope_theta"], d // 2
    p = theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)

    def at(rot):
        return d * math.log(y.original_max_position / (rot * 2 * math.pi)) / (2 * math.log(theta))

    low, high = at(y.beta_fast), at(y.beta_slow)
    if y.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    ramp = ((torch.arange(half, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    inv64 = (1 / (y.factor * p)) * ramp + (1 / p) * (1 - ramp)
    torch.testing.assert_close(yarn_inv_freq(d, theta, y).double(), inv64, rtol=1e-6, atol=0)
    c, s = cos_sin(POSITIONS[:6], d, theta, y)  # small positions: fp32 phase error stays tiny
    f = POSITIONS[:6].double()[:, None] * inv64[None]
    torch.testing.assert_close(c.double(), f.cos() * y.attention_factor, rtol=0, atol=2e-4)
    torch.testing.assert_close(s.double(), f.sin() * y.attention_factor, rtol=0, atol=2e-4)


def test_default_rope_unchanged():
    pos = torch.arange(0, 262144, 997)
    c, s = cos_sin(pos, 128, 1e6)
    f = pos.float()[:, None] * (1.0 / (1e6 ** (torch.arange(0, 128, 2, dtype=torch.int64).float() / 128)))[None]
    assert torch.equal(c, f.cos()) and torch.equal(s, f.sin())  # the formula before YaRN, op for op
    assert rope_scaling(None) is None and rope_scaling({"rope_type": "default", "rope_theta": 1e6}) is None
    assert torch.equal(cos_sin(pos, 64, 1e4, None)[0], cos_sin(pos, 64, 1e4)[0])
    assert inv_freq(64, 1e4).dtype == torch.float32


@pytest.mark.parametrize("params,needle", [
    ({"rope_type": "linear", "factor": 2.0}, "rope_type 'linear'"),
    ({"rope_type": "dynamic", "factor": 2.0}, "rope_type 'dynamic'"),
    ({"rope_type": "llama3", "factor": 8.0}, "rope_type 'llama3'"),
    ({"rope_type": "longrope"}, "rope_type 'longrope'"),
    ({"rope_type": "yarn", "factor": 4.0}, "original_max_position_embeddings"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "attn_factor": 0.9}, "attn_factor"),
    ({"rope_type": "default", "partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    # read differently by transformers and SGLang 0.5.17: refused on both sides alike
    ({"rope_type": "yarn", "original_max_position_embeddings": 64}, "yarn factor, attention_factor"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "attention_factor": 0.8},
     "yarn attention_factor"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 0}, "yarn beta_fast"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 0, "mscale_all_dim": 0},
     "yarn attention_factor"),
])
def test_other_rope_types_refused(params, needle):
    with pytest.raises(ValueError, match=needle):
        rope_scaling(params, 4096)


def test_yarn_attention_factor_accepted_when_both_sides_agree():
    same = 0.1 * math.log(4.0) + 1.0  # what SGLang computes; transformers takes the given value
    y = rope_scaling({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                      "attention_factor": same}, 256)
    assert y == Yarn(4.0, 64, 32.0, 1.0, True, same)


@pytest.fixture
def sglang_rope(monkeypatch):
    """SGLang's ``get_rope`` with the base constructor reduced to its fields (the real one builds a
    cache on CUDA): the instances carry exactly what SGLang derives from the config."""
    from sglang.srt.layers.rotary_embedding import factory
    from sglang.srt.layers.rotary_embedding.base import RotaryEmbedding

    def fields_only(self, head_size, rotary_dim, max_position_embeddings, base, is_neox_style, dtype):
        torch.nn.Module.__init__(self)
        self.head_size, self.rotary_dim, self.max_position_embeddings = head_size, rotary_dim, max_position_embeddings
        self.base, self.is_neox_style, self.dtype = base, is_neox_style, dtype

    monkeypatch.setattr(RotaryEmbedding, "__init__", fields_only)
    monkeypatch.setattr(factory, "_ROPE_DICT", {})
    return lambda d, max_pos, rope: factory.get_rope(d, d, max_pos, rope["rope_theta"], True, dict(rope), torch.bfloat16)


@pytest.mark.parametrize("d,max_pos,rope", CONFIGS)
def test_sglang_yarn_instance_reads_as_the_config(sglang_rope, d, max_pos, rope):
    from true_on_policy.patches.rope import check_built, rope_of

    emb = sglang_rope(d, max_pos, rope)
    cfg = _config(d, max_pos, rope)
    assert type(emb).__name__ == "YaRNScalingRotaryEmbedding"
    assert rope_of(emb) == rope_scaling(cfg.rope_parameters, max_pos)
    check_built(emb, cfg)
    assert torch.equal(emb._compute_inv_freq(emb.scaling_factor), yarn_inv_freq(d, rope["rope_theta"], rope_of(emb)))


def test_sglang_instances_refused_when_they_differ_or_are_other_classes(sglang_rope):
    from true_on_policy.kernels.rope import _read_yarn
    from true_on_policy.patches.rope import check_built, rope_of

    from true_on_policy.patching import PatchError

    d, max_pos, rope = CONFIGS[1]
    for odd in (dict(rope, attention_factor=0.8),  # SGLang's YaRN ignores attention_factor; transformers uses it
                dict(rope, mscale=0, mscale_all_dim=0),  # SGLang: a ratio of 1; transformers: 0.1*ln(factor)+1
                {k: v for k, v in rope.items() if k != "factor"}):  # SGLang: factor 1.0; transformers: 128/64
        emb = sglang_rope(d, max_pos, odd)
        assert rope_of(emb) == _read_yarn(odd, max_pos, 64)[1]  # our statement of SGLang's reading is SGLang's
        with pytest.raises(PatchError, match="SGLang 0.5.17 reads"):  # (transformers 5 refuses a missing factor)
            check_built(emb, types.SimpleNamespace(rope_parameters=odd, max_position_embeddings=max_pos))
    plain = {"rope_type": "default", "rope_theta": 1e6}
    check_built(sglang_rope(d, max_pos, plain), _config(d, max_pos, plain))
    with pytest.raises(PatchError, match="would compute different models"):  # a yarn config, a plain instance
        check_built(sglang_rope(d, max_pos, plain), _config(d, max_pos, rope))
    with pytest.raises(PatchError, match="LinearScalingRotaryEmbedding is not in the contract"):
        rope_of(sglang_rope(d, max_pos, {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}))


def test_patched_trainer_runs_yarn():
    from transformers import Qwen3MoeForCausalLM

    from true_on_policy.trainer import patch_hf_model, token_logprobs

    base = dict(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=4, num_experts_per_tok=2,
                max_position_embeddings=512, mlp_only_layers=[])
    rope = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "rope_theta": 1e6}
    torch.manual_seed(0)
    yarn = Qwen3MoeForCausalLM(Qwen3MoeConfig(**base, rope_parameters=rope)).bfloat16().eval()
    plain = Qwen3MoeForCausalLM(Qwen3MoeConfig(**base, rope_parameters={"rope_type": "default", "rope_theta": 1e6}))
    plain.load_state_dict(yarn.state_dict())
    plain = plain.bfloat16().eval()
    ids = torch.randint(0, 128, (2, 150), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        stock = torch.log_softmax(yarn(ids).logits.double(), -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    patch_hf_model(yarn)
    patch_hf_model(plain)
    pos = torch.arange(150)[None]
    c, s = yarn.model.rotary_emb(None, pos)
    want = cos_sin(pos[0], 64, 1e6, rope_scaling(rope))
    assert torch.equal(c[0], want[0]) and torch.equal(s[0], want[1])
    with torch.no_grad():
        lp, lp_plain = token_logprobs(yarn, ids).double(), token_logprobs(plain, ids).double()
    d = (lp - stock).abs()
    assert d.mean() < 0.005, d.mean()  # stock transformers runs YaRN too (cos/sin rounded to bf16)
    assert (lp - lp_plain).abs().mean() > 10 * d.mean()  # and plain RoPE is a different model


def test_inv_freq_is_built_once_per_config_with_the_same_bits(monkeypatch):
    """cos_sin takes its inv_freq from a cache keyed by (head_dim, theta, scaling, device): built
    by the same ops the first time, reused after (no per-layer inv_freq kernels), never shared
    between configs."""
    import true_on_policy.kernels.rope as rope

    y = Yarn(4.0, 64)
    pos = torch.arange(0, 5000, 7)
    fresh = {None: rope.inv_freq(64, 1e6), y: rope.yarn_inv_freq(64, 1e6, y)}
    monkeypatch.setattr(rope, "_INV_FREQ", {})
    calls = []
    real = rope.inv_freq
    monkeypatch.setattr(rope, "inv_freq", lambda *a: calls.append(a) or real(*a))
    for scaling in (None, y):
        first = rope.cos_sin(pos, 64, 1e6, scaling)
        again = rope.cos_sin(pos[:10], 64, 1e6, scaling)
        assert torch.equal(rope.inv_freq_cached(64, 1e6, scaling, "cpu"), fresh[scaling])
        assert torch.equal(again[0], first[0][:10]) and torch.equal(again[1], first[1][:10])
    assert len(calls) == 1  # default RoPE built its inv_freq once, for both calls
    assert not torch.equal(rope.inv_freq_cached(64, 1e4, None, "cpu"), fresh[None])  # another theta, another entry
    assert len(rope._INV_FREQ) == 3


def test_cached_inv_freq_first_built_in_inference_mode_serves_autograd(monkeypatch):
    import true_on_policy.kernels.rope as rope

    monkeypatch.setattr(rope, "_INV_FREQ", {})
    pos = torch.arange(6)
    with torch.inference_mode():
        c0, _ = rope.cos_sin(pos, 64, 1e6)
    x = torch.randn(6, 2, 64, requires_grad=True)
    c, s = rope.cos_sin(pos, 64, 1e6)
    rope.apply_rope_reference(x, c, s).float().sum().backward()  # would fail on an inference tensor saved
    assert x.grad is not None and torch.equal(c, c0)
    assert not rope.inv_freq_cached(64, 1e6, None, "cpu").is_inference()
