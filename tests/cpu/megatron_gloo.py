"""CPU processes over gloo, reference provider: the Megatron trainer at TP2, TP2 + SP, EP2 (expert
ranks in the data-parallel dimension: each rank its own rows), TP2 + EP2 + SP (expert TP 1), PP2
(even split, and uneven ``pp2u``: 2 + 1 layers of a 3-layer model) on two ranks, and TP2 x PP2
(with and without SP) on four, against the TP1 results the calling test saved; ``tp2flat``: TP2
under the tree-width-1 contract is refused, naming the contracts that fit. Log-probs (plain and
truncated) bitwise equal, on every rank (PP: the last stage's, broadcast); gradients close (the
backward is a reference); the export of the sharded (or staged) model bitwise the checkpoint.
Run: python -m torch.distributed.run --nproc_per_node N THIS CHECKPOINT TP1_RESULTS.pt LAYOUT..."""
import sys
import warnings

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")
from megatron.core import parallel_state as ps  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoConfig  # noqa: E402

from true_on_policy import megatron as tm  # noqa: E402

LAYOUTS = {"tp2": dict(tp=2, ep=1, etp=2, sp=False), "tp2sp": dict(tp=2, ep=1, etp=2, sp=True),
           "ep2": dict(tp=1, ep=2, etp=1, sp=False), "tp2ep2sp": dict(tp=2, ep=2, etp=1, sp=True),
           "pp2": dict(tp=1, ep=1, etp=1, sp=False, pp=2), "pp2u": dict(tp=1, ep=1, etp=1, sp=False, pp=2, first=2),
           "tp2pp2": dict(tp=2, ep=1, etp=2, sp=False, pp=2), "tp2pp2sp": dict(tp=2, ep=1, etp=2, sp=True, pp=2),
           "tp2flat": dict(tp=2, ep=1, etp=2, sp=False, refused="qwen3_moe_true_on_policy_flat_v1")}


def bitwise(got, want, what):
    if not torch.equal(got, want):
        d = (got - want).abs()
        raise AssertionError(f"{what}: max |d| {d.max().item():.3e}, {int((d > 0).sum())} of {d.numel()} differ")


def run(path, ref, name):
    lay = LAYOUTS[name]
    pp = lay.get("pp", 1)
    ps.initialize_model_parallel(lay["tp"], pp, expert_model_parallel_size=lay["ep"],
                                 expert_tensor_parallel_size=lay["etp"])
    cfg = AutoConfig.from_pretrained(path)
    hf = load_file(f"{path}/model.safetensors")  # the checkpoint's per-expert names (SGLang's)
    model = tm.build_model(cfg, sequence_parallel=lay["sp"], num_layers_in_first_pipeline_stage=lay.get("first"))
    tm.load_hf(model, hf)
    if "refused" in lay:  # before the tree width is set: the process may go on under its own contract
        try:
            tm.patch_megatron_model(model, lay["refused"])
        except tm.MegatronLayoutError as e:
            msg = str(e)
        else:
            raise AssertionError(f"{name}: patched under {lay['refused']}")
        for want in ("tensor parallel 2 does not divide", "expert tensor parallel 2", "qwen3_moe_true_on_policy_v1",
                     "qwen3_moe_true_on_policy_tp_preview_v1", "--true-on-policy-contract"):
            assert want in msg, (want, msg)
        assert not hasattr(model, "_true_on_policy_state"), "the refused model was patched"
        ps.destroy_model_parallel()
        print(f"megatron-ok {name} rank {dist.get_rank()}", flush=True)
        return
    rec = tm.patch_megatron_model(model, ref["contract"])  # the contract the TP1 reference ran under
    assert rec["layout"]["pp"] == pp, rec
    if pp > 1:  # this stage's layers (megatron-core's split) and its end modules
        stage, n = ps.get_pipeline_model_parallel_rank(), cfg.num_hidden_layers
        split = [lay["first"], n - lay["first"]] if "first" in lay else [n // 2, n // 2]
        assert rec["layout"]["stage_layers"] == [sum(split[:stage]), split[stage]], rec
        assert hasattr(model, "embedding") == (stage == 0) and hasattr(model, "output_layer") == (stage == 1)
    rank, dp_ep = dist.get_rank(), lay["tp"] == 1 and lay["ep"] > 1
    rows = slice(2 * rank, 2 * rank + 2) if dp_ep else slice(None)  # EP2 at TP1: data-parallel rows
    ids, mask = ref["ids"][rows], ref["mask"][rows]
    with torch.no_grad():
        bitwise(tm.token_logprobs(model, ids, mask, 0.7), ref["lp"][rows], f"{name} log-probs")
        bitwise(tm.token_logprobs(model, ids, mask, 0.7, top_k=5, top_p=0.9), ref["lp_trunc"][rows],
                f"{name} truncated log-probs")
    # export of the sharded model: the checkpoint, name for name, bit for bit
    out = dict(tm.sglang_named_tensors(model))
    assert set(out) == set(hf), sorted(set(out) ^ set(hf))[:5]
    for k in hf:
        bitwise(out[k], hf[k], f"{name} export {k}")
    # backward: gradients of the summed log-prob of real tokens, close to TP1's
    loss = -(tm.token_logprobs(model, ids, mask, 0.7) * mask[:, 1:]).sum()
    loss.backward()
    tm.finalize_grads(model)
    if dp_ep:  # EP as data parallel: non-expert gradients are summed over the DP ranks (DDP's job)
        for n, p in model.named_parameters():
            if "local_experts" not in n:
                dist.all_reduce(p.grad)
    grads = tm.hf_state_dict(model, grads=True)
    for k, want in ref["grads"].items():
        got = grads[k].float()
        err = (got - want.float()).norm() / want.float().norm().clamp_min(1e-12)
        assert err < 3e-2, f"{name} grad {k}: relative error {err:.3e}"
    ps.destroy_model_parallel()
    print(f"megatron-ok {name} rank {rank}", flush=True)


if __name__ == "__main__":
    dist.init_process_group("gloo")
    path, ref = sys.argv[1], torch.load(sys.argv[2])
    for name in sys.argv[3:]:
        run(path, ref, name)
    dist.destroy_process_group()
