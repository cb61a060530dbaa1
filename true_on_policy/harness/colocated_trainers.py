"""The trainers of the colocated loop (``harness/colocated.py``), one interface:

    t = make("hf" | "megatron", model_path, contract or None (stock), lr, device, backward="forms")
    lp = t.logprobs(inputs, outs)      # [B, S-1] fp32 log-probs of the right-padded prompt + sample rows
    t.step(loss)                       # backward, one AdamW step, gradients dropped
    t.named_tensors()                  # [(checkpoint name, CUDA tensor)] for update_weights_from_tensor
    t.handshake(rollout)               # check_rollout against every rollout process's manifest
    t.weight_bytes, t.vocab_size; t.close()

``hf``: transformers, patched (``true_on_policy.trainer``) under the contract, or stock
(``log_softmax(logits.float() / T)``); ``megatron``: megatron-core TP1 through
``true_on_policy.megatron`` (one process, its own one-rank NCCL group).
"""

from __future__ import annotations

T = 1.0


def _batch(inputs, outs, device):
    from true_on_policy.trainer import right_pad

    return right_pad([p + list(t) for p, (t, _) in zip(inputs, outs, strict=True)], device)


def _sync(device) -> None:
    """The step's kernels done before its time is taken (the update over CUDA IPC waits for them
    anyway: torch shares a CUDA tensor with an event the receiver waits on)."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def stock_token_logprobs(model, ids, mask, temperature: float = T):
    """Stock transformers: fp32 ``log_softmax(logits / T)`` at each next token, [B, S-1]."""
    import torch

    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    return torch.log_softmax(logits / temperature, dim=-1).gather(-1, ids[:, 1:, None])[..., 0]


class HFTrainer:
    def __init__(self, model_path: str, contract: str | None, lr: float, device, backward: str = "forms"):
        import torch
        from transformers import AutoModelForCausalLM

        self.device, self.contract = device, contract
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16).to(device).eval()
        if contract is not None:
            from true_on_policy.trainer import patch_hf_model

            patch_hf_model(self.model, contract, backward=backward)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.vocab_size = self.model.config.vocab_size

    def logprobs(self, inputs, outs, grad: bool = True):
        import torch

        from true_on_policy.trainer import token_logprobs

        ids, mask = _batch(inputs, outs, self.device)
        with torch.set_grad_enabled(grad):
            if self.contract is None:
                return stock_token_logprobs(self.model, ids, mask)
            return token_logprobs(self.model, ids, mask, T)

    def step(self, loss) -> None:
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)  # the gradients' memory goes back before the engine resumes
        _sync(self.device)

    def named_tensors(self):
        from true_on_policy.rollout.actor import checkpoint_named_tensors

        return [(n, t.detach()) for n, t in checkpoint_named_tensors(self.model)]

    def handshake(self, rollout):
        from true_on_policy.trainer import check_rollout

        return check_rollout(rollout, self.model)

    def close(self) -> None:
        import torch

        del self.model, self.opt
        torch.cuda.empty_cache()


class MegatronTrainer:
    def __init__(self, model_path: str, contract: str | None, lr: float, device, backward: str = "forms"):
        import glob

        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state as ps
        from safetensors.torch import load_file
        from transformers import AutoConfig

        from true_on_policy import megatron as tm

        if contract is None:
            raise ValueError("the stock loop runs the transformers trainer (--trainer hf)")
        self.device = device
        if not dist.is_initialized():
            dist.init_process_group("nccl", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
        ps.initialize_model_parallel(1, 1)
        cfg = AutoConfig.from_pretrained(model_path)
        self.model = tm.build_model(cfg).to(device)
        state = {}
        for f in sorted(glob.glob(f"{model_path}/*.safetensors")):
            state.update({k: v.to(device) for k, v in load_file(f).items()})
        tm.load_hf(self.model, state)
        del state
        tm.patch_megatron_model(self.model, contract, backward=backward)
        self.model.eval()  # as the GPU parity test ran it; gradients flow in eval mode too
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.weight_bytes = sum(t.numel() * t.element_size() for _, t in tm.sglang_named_tensors(self.model))
        self.vocab_size = cfg.vocab_size
        self._named = None

    def logprobs(self, inputs, outs, grad: bool = True):
        import torch

        from true_on_policy import megatron as tm

        ids, mask = _batch(inputs, outs, self.device)
        with torch.set_grad_enabled(grad):
            return tm.token_logprobs(self.model, ids, mask, temperature=T)

    def step(self, loss) -> None:
        from true_on_policy import megatron as tm

        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        tm.finalize_grads(self.model)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        _sync(self.device)

    def named_tensors(self):
        """Whole tensors under the checkpoint's names (copies): kept here until the next call, so
        they outlive the update that reads them over CUDA IPC."""
        from true_on_policy import megatron as tm

        self._named = tm.sglang_named_tensors(self.model)
        return self._named

    def handshake(self, rollout):
        from true_on_policy import megatron as tm

        return tm.check_rollout(rollout, self.model)

    def close(self) -> None:
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        del self.model, self.opt, self._named
        ps.destroy_model_parallel()
        dist.destroy_process_group()
        torch.cuda.empty_cache()


TRAINERS = {"hf": HFTrainer, "megatron": MegatronTrainer}


def make(name: str, model_path: str, contract: str | None, lr: float, device, backward: str = "forms"):
    try:
        cls = TRAINERS[name]
    except KeyError:
        raise ValueError(f"unknown trainer {name!r}; known: {', '.join(TRAINERS)}") from None
    return cls(model_path, contract, lr, device, backward)
