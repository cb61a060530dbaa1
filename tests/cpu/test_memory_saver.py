"""SGLang's memory saver (``--enable-memory-saver``, ``release_memory_occupation`` /
``resume_memory_occupation``) under the overlay, on the CPU against the real sglang 0.5.17.

The decision: accepted by every contract. The memory saver changes where tensors live (its own
allocator, pausable per tag) and never a kernel, an operand or an order, so it changes no bit of
what the engine computes -- as long as every tensor a release frees is rewritten before it is
read again. SGLang rewrites the KV cache (flushed), the graph pool (every replay writes what it
reads there), the weights (the trainer's update) and the model's buffers (its static-state copy).
The overlay's one tensor allocated while the model loads that is none of these, the warmed RoPE
inv_freq, is kept as a buffer (``patches.rope.keep_inv_freq``), so SGLang's copy restores it.
The GPU test (``tests/gpu/test_colocated_gpu.py``) checks rollout == trainer after each release,
step, resume and update.
"""

import pytest
import torch

from true_on_policy import tiny_model
from true_on_policy.contract import get_contract, known_contracts, launch_plan


@pytest.mark.parametrize("name", known_contracts())
def test_every_contract_accepts_the_memory_saver(tiny_cache, clean_env, name):
    c = get_contract(name)
    assert not [r for r in c.args if "memory_saver" in r.dest], "a rule on the memory saver: update this test"
    extra = {"tp_size": 2} if "tp_preview" in name else {}  # a layout the contract serves (its rules are judged whole)
    plan = launch_plan.build_plan_from_kwargs(c, {"enable_memory_saver": True, **extra},
                                              default_model=tiny_model.ensure)
    assert plan.server_args.enable_memory_saver is True
    cli = launch_plan.build_plan(c, ["--enable-memory-saver"] + [f"--{k.replace('_', '-')}={v}" for k, v in extra.items()],
                                 default_model=tiny_model.ensure)
    assert cli.server_args.enable_memory_saver is True


def _layers_sharing(emb):
    """A model whose layers share one rotary embedding, as SGLang's get_rope caches it."""
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Module() for _ in range(3)])
    for layer in model.layers:
        layer.rotary_emb = emb
    return model


@pytest.mark.parametrize("scaled", [False, True])
def test_the_warmed_inv_freq_survives_release_and_resume(scaled):
    """SGLang's own release/resume copy of the model's static state (no GPU: the memory saver's
    pause is stood in for by overwriting the tensor, as a fresh physical page would)."""
    from sglang.srt.managers.scheduler_components.weight_updater import _export_static_state, _import_static_state
    from true_on_policy.kernels.rope import Yarn, inv_freq, inv_freq_cached, yarn_inv_freq
    from true_on_policy.patches.rope import INV_FREQ_BUFFER, keep_inv_freq

    d, theta = 64, 1e6
    yarn = Yarn(4.0, 32768, 32.0, 1.0, True, 1.0) if scaled else None
    emb = torch.nn.Module()
    inv = inv_freq_cached(d, theta, yarn, "cpu")
    keep_inv_freq(emb, inv)
    keep_inv_freq(emb, inv)  # a second build of the same layer: the same buffer
    model = _layers_sharing(emb)
    assert INV_FREQ_BUFFER not in "".join(model.state_dict())  # not a checkpoint tensor
    state = _export_static_state(model)  # release_memory_occupation, before the pause
    assert [n for n, _ in state["buffers"]] == [f"layers.0.rotary_emb.{INV_FREQ_BUFFER}"]  # shared: one copy
    ptr = inv.data_ptr()
    inv.fill_(float("nan"))  # the weights region after a pause and resume, without a CPU backup
    _import_static_state(model, state)  # resume_memory_occupation
    want = yarn_inv_freq(d, theta, yarn, "cpu") if scaled else inv_freq(d, theta, "cpu")
    got = inv_freq_cached(d, theta, yarn, "cpu")
    assert got is inv and got.data_ptr() == ptr  # the tensor the layers (and captured graphs) read
    diff = (got.double() - want.double()).abs()
    print(f"inv_freq after resume: max|d|={float(diff.nan_to_num(float('inf')).max())} differing={int((got != want).sum())}")
    assert torch.equal(got, want)


def test_without_the_buffer_the_pause_would_lose_it():
    """The guard above is needed: an inv_freq outside the model's buffers is not in SGLang's copy."""
    from sglang.srt.managers.scheduler_components.weight_updater import _export_static_state

    model = _layers_sharing(torch.nn.Module())
    assert _export_static_state(model)["buffers"] == []

