"""Megatron trainer (true_on_policy.megatron, Triton provider) against the SGLang rollout. Skipped
without megatron-core (``pip install -e '.[megatron]'``) and, for the two-GPU test, with fewer than
two GPUs.

Chain, at the Qwen3-30B-A3B layer shape (6 layers), under the flat default and under v1 (the
contract a Megatron trainer at TP or expert-TP > 1 needs): rollout (TP1) == Megatron TP1 bitwise,
the handshake passes -> one optimizer step, the weights exported (``sglang_named_tensors``) and
pushed with ``update_weights_from_tensor``, a new rollout == the stepped Megatron model bitwise ->
Megatron TP2, TP2+SP, EP2, TP2+EP2+SP (two GPUs, NCCL; tests/gpu/megatron_dist.py) == rollouts at
SGLang TP1 and TP2 (preview contract) bitwise.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from true_on_policy import DEFAULT_CONTRACT

pytestmark = pytest.mark.gpu
pytest.importorskip("megatron.core")

ROOT = Path(__file__).resolve().parent.parent.parent
T = 0.7
N_PROMPTS, NEW_TOKENS = 16, 32
PREVIEW = "qwen3_moe_true_on_policy_tp_preview_v1"
V1 = "qwen3_moe_true_on_policy_v1"
GEOMETRY = "a3b6"  # the Qwen3-30B-A3B layer shape, 6 layers


def _rollout(eng, seed=0):
    from true_on_policy.harness.parity import make_prompts, sampled

    prompts = make_prompts(N_PROMPTS, 256, seed=11)
    params = [{"temperature": T, "max_new_tokens": NEW_TOKENS, "ignore_eos": True, "sampling_seed": 700 + seed + i}
              for i in range(N_PROMPTS)]
    return prompts, [sampled(o) for o in eng.generate(input_ids=prompts, sampling_params=params)]


def _batch(prompts, outs):
    """(ids, mask, rollout log-probs at the trainer's positions, where they are) for the trainer."""
    import torch

    from true_on_policy.trainer import right_pad

    seqs = [p + toks for p, (toks, _) in zip(prompts, outs, strict=True)]
    ids, mask = right_pad(seqs)
    want = torch.zeros(ids.shape[0], ids.shape[1] - 1)
    where = torch.zeros_like(want, dtype=torch.bool)
    for i, (p, (_, lp)) in enumerate(zip(prompts, outs, strict=True)):
        want[i, len(p) - 1:len(p) - 1 + len(lp)] = torch.tensor(lp, dtype=torch.float32)
        where[i, len(p) - 1:len(p) - 1 + len(lp)] = True
    return dict(ids=ids, mask=mask, rollout_lp=want, where=where, temperature=T)


def _parity(model, ref) -> dict:
    import torch

    from true_on_policy import megatron as tm

    with torch.no_grad():
        lp = tm.token_logprobs(model, ref["ids"].cuda(), ref["mask"].cuda(), temperature=T).cpu()
    got, want = lp[ref["where"]], ref["rollout_lp"][ref["where"]]
    d = (got.double() - want.double()).abs()
    out = {"max_abs_diff": float(d.max()), "differing": int((d > 0).sum()), "tokens": int(d.numel())}
    print(f"megatron parity: {out}")
    return out


@pytest.fixture(scope="module")
def one_gpu_megatron():
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    torch.cuda.set_device(0)
    ps.initialize_model_parallel(1, 1)
    yield
    ps.destroy_model_parallel()
    dist.destroy_process_group()


@pytest.mark.parametrize("contract", [DEFAULT_CONTRACT, V1])
def test_megatron_tp1_rollout_parity_step_and_weight_push(tiny_cache, one_gpu_megatron, gpu_evidence, contract):
    import glob

    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from true_on_policy import megatron as tm
    from true_on_policy import tiny_model
    from true_on_policy.rollout.engine import TrueOnPolicyEngine

    path = tiny_model.ensure(GEOMETRY)
    model = tm.build_model(AutoConfig.from_pretrained(path)).cuda()
    state = {}
    for f in sorted(glob.glob(f"{path}/*.safetensors")):
        state.update({k: v.cuda() for k, v in load_file(f).items()})
    tm.load_hf(model, state)
    del state
    record = tm.patch_megatron_model(model, contract)
    assert record["provider"] == "triton" and record["contract"] == contract, record
    with TrueOnPolicyEngine(model_path=path, contract=contract, mem_fraction_static=0.3) as eng:
        tm.check_rollout(eng, model)
        before = _parity(model, _batch(*_rollout(eng)))
        ref = _batch(*_rollout(eng, seed=100))
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        lp = tm.token_logprobs(model, ref["ids"].cuda(), ref["mask"].cuda(), temperature=T)
        (-(lp * ref["where"].cuda()).sum() / ref["where"].sum()).backward()
        opt.step()
        model.eval()
        named = tm.sglang_named_tensors(model)
        ok = eng.engine.update_weights_from_tensor(named_tensors=named)
        assert not isinstance(ok, tuple) or ok[0], ok
        after = _parity(model, _batch(*_rollout(eng, seed=200)))
    del model, opt, named
    torch.cuda.empty_cache()
    gpu_evidence.append({"test": "megatron_tp1_rollout", "contract": contract, "geometry": GEOMETRY,
                         "before_step": before, "after_step": after})
    for r in (before, after):
        assert r["max_abs_diff"] == 0.0 and r["differing"] == 0, r


@pytest.mark.parametrize("rollout_tp", [1, 2])
def test_megatron_two_gpu_layouts_vs_rollout(tiny_cache, tmp_path, gpu_evidence, rollout_tp):
    import torch

    from true_on_policy import tiny_model
    from true_on_policy.rollout.engine import TrueOnPolicyEngine

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    path = tiny_model.ensure("embedded")
    kw = dict(contract=PREVIEW, tp_size=2) if rollout_tp == 2 else {}
    with TrueOnPolicyEngine(model_path=path, mem_fraction_static=0.3, **kw) as eng:
        ref = _batch(*_rollout(eng))
    torch.save(ref, tmp_path / "rollout.pt")
    layouts = ["tp2", "tp2sp", "ep2", "tp2ep2sp", "pp2"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        str(ROOT / "tests" / "gpu" / "megatron_dist.py"), path, str(tmp_path / "rollout.pt"), *layouts],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    gpu_evidence.append({"test": f"megatron_layouts_vs_rollout_tp{rollout_tp}",
                         "lines": [x for x in r.stdout.splitlines() if "max|d|" in x]})
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-5000:])
    for name in layouts:
        assert r.stdout.count(f"megatron-ok {name} ") == 2, r.stdout
