"""Two GPUs over NCCL, Triton provider: the Megatron trainer at LAYOUT against a rollout's sampled
tokens and log-probs (saved by tests/gpu/test_megatron_gpu.py), bitwise (PP2: on both stages, the
last stage's log-probs broadcast).
Run: python -m torch.distributed.run --nproc_per_node 2 THIS CHECKPOINT ROLLOUT.pt LAYOUT..."""
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
           "pp2": dict(tp=1, ep=1, etp=1, sp=False, pp=2)}


def run(path, ref, name):
    lay = LAYOUTS[name]
    ps.initialize_model_parallel(lay["tp"], lay.get("pp", 1), expert_model_parallel_size=lay["ep"],
                                 expert_tensor_parallel_size=lay["etp"])
    model = tm.build_model(AutoConfig.from_pretrained(path), sequence_parallel=lay["sp"],
                           use_cpu_initialization=True).cuda()
    tm.load_hf(model, {k: v.cuda() for k, v in load_file(f"{path}/model.safetensors").items()})
    tm.patch_megatron_model(model)
    ids, mask, want, where = (ref[k].cuda() for k in ("ids", "mask", "rollout_lp", "where"))
    rows = torch.arange(ids.shape[0], device="cuda")
    if lay["tp"] == 1 and lay["ep"] > 1:  # EP as data parallel: each rank its half of the rows (an even count is sampled)
        half = ids.shape[0] // 2
        rows = rows[dist.get_rank() * half:(dist.get_rank() + 1) * half]
    with torch.no_grad():
        lp = tm.token_logprobs(model, ids[rows], mask[rows], temperature=ref["temperature"])
    got, exp = lp[where[rows]], want[rows][where[rows]]
    d = (got.double() - exp.double()).abs()
    print(f"{name} rank {dist.get_rank()}: max|d|={d.max().item()} differing={int((d > 0).sum())} of {d.numel()}")
    assert torch.equal(got, exp), name
    ps.destroy_model_parallel()
    print(f"megatron-ok {name} rank {dist.get_rank()}", flush=True)


if __name__ == "__main__":
    dist.init_process_group("nccl")
    torch.cuda.set_device(dist.get_rank())
    path, ref = sys.argv[1], torch.load(sys.argv[2])
    for name in sys.argv[3:]:
        run(path, ref, name)
    dist.destroy_process_group()
