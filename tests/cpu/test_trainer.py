"""Trainer side on the CPU (reference provider): the patched transformers Qwen3-MoE against a
float64 evaluation and the stock model; padding and micro-batch invariance bitwise; patch
idempotent and reversible; bad models and requests refused; one optimizer step."""

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from true_on_policy import tiny_model
from true_on_policy.trainer import TrainerPatchError, patch_hf_model, right_pad, token_logprobs, unpatch_hf_model


@pytest.fixture(scope="module")
def path(tiny_cache):
    return tiny_model.ensure()


@pytest.fixture
def model(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()


def _seqs(seed, lengths, vocab=512):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lengths]


def _stock_lp(m, ids):
    with torch.no_grad():
        return torch.log_softmax(m(ids).logits.double(), -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]


def test_patched_logprobs_close_to_float64_and_to_stock(model, path):
    ids = torch.stack(_seqs(0, [48, 48, 48]))
    stock = _stock_lp(model, ids)
    m64 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, experts_implementation="eager").eval()
    f64 = _stock_lp(m64, ids)
    patch_hf_model(model)
    with torch.no_grad():
        lp = token_logprobs(model, ids).double()
    assert lp.shape == (3, 47) and lp.dtype == torch.float64
    d64, dstock = (lp - f64).abs(), (lp - stock).abs()
    # bf16 rounding flips a few routing decisions in any bf16 model, so the max is loose; the
    # bulk must be tight: mean and 90th percentile (a wrong op gives means of 0.3 and more)
    assert d64.mean() < 0.05 and d64.quantile(0.9) < 0.08, (d64.mean(), d64.quantile(0.9))
    assert dstock.mean() < 0.05 and dstock.quantile(0.9) < 0.08, (dstock.mean(), dstock.quantile(0.9))
    assert d64.mean() < 1.5 * (stock - f64).abs().mean()  # no worse than stock bf16 in bulk


def test_padding_and_micro_batch_invariance_bitwise(model):
    patch_hf_model(model)
    seqs = _seqs(1, [30, 7, 45, 2, 30, 19])
    with torch.no_grad():
        alone = [token_logprobs(model, s[None])[0] for s in seqs]
        ids, mask = right_pad(seqs)
        batch = token_logprobs(model, ids, mask)
        for r, s in enumerate(seqs):
            assert torch.equal(batch[r, :len(s) - 1], alone[r]), r
        for mb in (1, 2, 4):
            for i in range(0, len(seqs), mb):
                ids, mask = right_pad(seqs[i:i + mb])
                got = token_logprobs(model, ids, mask, 1.0)
                for r, s in enumerate(seqs[i:i + mb]):
                    assert torch.equal(got[r, :len(s) - 1], alone[i + r]), (mb, i + r)


def test_logits_to_keep_is_the_tail_bitwise(model):
    """``logits_to_keep=n`` runs lm_head on the last n + 1 positions only and returns exactly the
    last n columns of the full result, untruncated and truncated, padded batch included."""
    patch_hf_model(model)
    ids, mask = right_pad(_seqs(8, [40, 25, 33]))
    with torch.no_grad():
        full = token_logprobs(model, ids, mask, 0.8)
        full_trunc = token_logprobs(model, ids, mask, 0.8, top_k=20, top_p=0.9)
        for n in (1, 7, ids.shape[1] - 1):
            tail = token_logprobs(model, ids, mask, 0.8, logits_to_keep=n)
            assert tail.shape == (3, n) and torch.equal(tail, full[:, -n:]), n
            trunc = token_logprobs(model, ids, mask, 0.8, top_k=20, top_p=0.9, logits_to_keep=n)
            assert torch.equal(trunc, full_trunc[:, -n:]), n
    seen = []
    hook = model.lm_head.register_forward_hook(lambda mod, args, out: seen.append(args[0].shape[1]))
    try:
        with torch.no_grad():
            token_logprobs(model, ids, mask, logits_to_keep=5)
    finally:
        hook.remove()
    assert seen == [6]  # lm_head saw 6 positions, not 40


@pytest.mark.parametrize("keep", [0, 40, True, 2.5, -1])
def test_logits_to_keep_out_of_range_is_refused(model, keep):
    patch_hf_model(model)
    ids = torch.stack(_seqs(9, [40]))
    with pytest.raises(TrainerPatchError, match=r"logits_to_keep must be an int in \[1, seq - 1 = 39\]"):
        token_logprobs(model, ids, logits_to_keep=keep)


def test_temperature_is_applied(model):
    patch_hf_model(model)
    ids = torch.stack(_seqs(2, [20]))
    with torch.no_grad():
        t1, t7 = token_logprobs(model, ids, temperature=1.0), token_logprobs(model, ids, temperature=0.7)
    assert not torch.equal(t1, t7) and torch.isfinite(t7).all()


def test_idempotent_reversible_and_manifest(model):
    ids = torch.stack(_seqs(3, [25, 25]))
    with torch.no_grad():
        before = model(ids).logits
    m1 = patch_hf_model(model)
    fwd = model.model.layers[0].self_attn.forward
    assert patch_hf_model(model) is m1 and model.model.layers[0].self_attn.forward == fwd
    rep = m1.patches[0].replacements
    n_layers = model.config.num_hidden_layers
    assert len(rep) == n_layers * 6 + 3  # per layer: 2 norms, attention, q/k norms, MoE; + final norm, rotary, lm_head
    assert any("self_attn" in r and "_attention_forward" in r for r in rep) and m1.fingerprint
    assert unpatch_hf_model(model) and not unpatch_hf_model(model)
    assert "forward" not in model.model.layers[0].self_attn.__dict__
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)
    with pytest.raises(TrainerPatchError, match="patch_hf_model"):
        token_logprobs(model, ids)


def test_refusals_list_every_problem(model):
    with pytest.raises(Exception, match="qwen3_moe_true_on_policy_v1"):
        patch_hf_model(model, contract="no_such_contract")
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    with pytest.raises(TrainerPatchError, match="LlamaForCausalLM is not supported"):
        patch_hf_model(llama)
    model.float()
    with pytest.raises(TrainerPatchError, match="bfloat16") as e:
        patch_hf_model(model, provider="triton")
    assert "CUDA" in str(e.value)  # both problems in one message
    assert "load with dtype=torch.bfloat16" in str(e.value)  # transformers 5's name (torch_dtype= is the old one)
    model.bfloat16()
    patch_hf_model(model)
    ids = torch.stack(_seqs(4, [10, 10]))
    with pytest.raises(TrainerPatchError, match="right-padded"):
        token_logprobs(model, ids, torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1, 1], [1] * 10]))
    with pytest.raises(TrainerPatchError, match="temperature"):
        token_logprobs(model, ids, temperature=0)


def test_one_optimizer_step(model):
    patch_hf_model(model)
    model.train()
    ids = torch.stack(_seqs(5, [24, 24]))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    before = model.model.layers[0].mlp.experts.down_proj.detach().clone()
    loss = -token_logprobs(model, ids).mean()
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert torch.isfinite(loss) and len(grads) > 10 and all(torch.isfinite(g).all() for g in grads)
    opt.step()
    assert not torch.equal(before, model.model.layers[0].mlp.experts.down_proj.detach())
    with torch.no_grad():
        assert -token_logprobs(model, ids).mean() < loss  # the step went downhill


@pytest.mark.parametrize("case, expect", [
    ("T=inf", "temperature must be a finite number > 0, got inf"),
    ("T=nan", "temperature must be a finite number > 0, got nan"),
    ("T=True", "temperature must be a finite number > 0, got True"),
    ("mask shape", "attention_mask must have the shape of input_ids (2, 10), got (2, 9)"),
    ("mask values", "attention_mask must hold only 0 and 1"),
    ("too long", "sequences of 4097 positions exceed max_position_embeddings 4096"),
    ("id = vocab", "input_ids must be token ids in [0, 512), got ids from 0 to 512"),
    ("negative id", "input_ids must be token ids in [0, 512), got ids from -1 to"),
    ("float ids", "input_ids must hold integer token ids, got torch.float32"),
])
def test_token_logprobs_refuses_bad_requests(model, case, expect):
    patch_hf_model(model)
    ids, mask, t = torch.stack(_seqs(6, [10, 10])), None, 1.0
    if case.startswith("T="):
        t = {"T=inf": float("inf"), "T=nan": float("nan"), "T=True": True}[case]
    elif case == "mask shape":
        mask = torch.ones(2, 9, dtype=torch.long)
    elif case == "mask values":
        mask = torch.full((2, 10), 2)
    elif case == "too long":
        ids = torch.zeros(1, 4097, dtype=torch.long)
    elif case == "id = vocab":
        ids[0, 3], ids[0, 0] = 512, 0
    elif case == "negative id":
        ids[1, 5] = -1
    elif case == "float ids":
        ids = ids.float()
    with pytest.raises(TrainerPatchError) as e:
        token_logprobs(model, ids, mask, temperature=t)
    assert expect in str(e.value), str(e.value)


def test_token_logprobs_lists_every_request_problem_at_once(model):
    patch_hf_model(model)
    ids = torch.stack(_seqs(7, [10, 10]))
    ids[0, 0] = 9999
    with pytest.raises(TrainerPatchError) as e:
        token_logprobs(model, ids, torch.ones(3, 10), temperature=float("inf"), top_p=2.0)
    msg = str(e.value)
    assert all(w in msg for w in ("input_ids must be token ids", "attention_mask must have the shape",
                                  "temperature must be", "top_p must be")), msg


@pytest.mark.parametrize("temperature", [float("inf"), float("nan"), 0.0, -1.0])
def test_logprob_kernel_entry_refuses_non_finite_temperature(temperature):
    from true_on_policy.kernels.logprobs import _check

    with pytest.raises(ValueError, match="temperature must be finite and > 0"):
        _check(torch.zeros(2, 8), torch.zeros(2, dtype=torch.long), temperature, 8)
    with pytest.raises(ValueError, match="temperature must be finite and > 0"):
        _check(torch.zeros(2, 8), torch.zeros(2, dtype=torch.long), torch.tensor([1.0, temperature]), 8)


def test_models_under_contracts_of_different_tree_widths_share_a_process(path):
    """``patch_hf_model`` binds its contract's row-parallel tree width into the model's ops; the
    process's width is the SGLang patches' and stays untouched. A model under the flat contract
    (width 1) and one under v1 (width 8) in one process each compute at their own width: the flat
    model's log-probs are bitwise the same before and after the v1 model is patched and run, and
    v1's differ from them."""
    from true_on_policy.kernels.tree_reduce import tree_width

    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    flat = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    assert patch_hf_model(flat, "qwen3_moe_true_on_policy_flat_v1").contract == "qwen3_moe_true_on_policy_flat_v1"
    with torch.no_grad():
        lp1 = token_logprobs(flat, ids)
        assert lp1.shape == (2, 23) and torch.isfinite(lp1).all()
        v1 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
        patch_hf_model(v1, "qwen3_moe_true_on_policy_v1")
        lp8 = token_logprobs(v1, ids)
        assert torch.equal(token_logprobs(flat, ids), lp1)  # the flat model still runs at width 1
    assert not torch.equal(lp8, lp1), "width 8 and width 1 gave the same bits: the width did not reach the ops"
    assert tree_width() == 8  # the process's width: not the trainers' to set
