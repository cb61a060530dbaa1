"""Pipeline stages of the Megatron trainer: the stage boundary and the log-probs broadcast.

Every rank of a pipeline group runs ``token_logprobs`` on the same batch. Stage ``p`` receives
the pair (residual, x) from stage ``p - 1``, runs its layers and sends the pair on; the last
stage computes the log-probs and broadcasts them over the pipeline group, so every rank returns
them. The pair is the residual stream and the last MoE output *unsummed*, exactly what the
single-stage forward holds between two layers (its next step is ``residual + x``, a bf16 add):
only copies cross the boundary, so a PP forward is the single-stage function bit for bit.

=====================  ==========================================  ===========================
function               forward                                     backward
=====================  ==========================================  ===========================
``send``               send (residual, x) to the next stage;        receive their gradients
                       returns a 0-element token                    from the next stage
``recv``               receive (residual, x) from the previous      send their gradients to
                       stage                                        the previous stage
``from_last``          broadcast the last stage's tensor over       own gradient on the last
                       the pipeline group                           stage; zero elsewhere
=====================  ==========================================  ===========================

Backward (a reference, as ``comm``'s): every rank of the pipeline group calls ``backward`` on a
loss of the returned log-probs; the last stage's loss is the one that drives the gradient (the
replicas' gradient is dropped, as ``copy_to``'s convention for a replicated tensor), and the
boundary gradients travel back by point-to-point. A rank that skips ``backward`` after a
forward with gradients leaves its neighbours waiting. megatron-core's pipeline schedules
(``forward_backward_func``, micro-batch interleaving) are not used: the stages run one after
another. Only send / recv / broadcast, which gloo and NCCL both have.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Stage:
    """This rank's pipeline stage: ``group`` None when there is one stage; ``prev`` / ``next`` /
    ``src`` are global ranks (previous stage, next stage, last stage of this pipeline)."""

    group: object = None
    first: bool = True
    last: bool = True
    prev: int | None = None
    next: int | None = None
    src: int | None = None

    @staticmethod
    def from_parallel_state() -> Stage:
        from megatron.core import parallel_state as ps

        n = ps.get_pipeline_model_parallel_world_size()
        if n == 1:
            return Stage()
        r = ps.get_pipeline_model_parallel_rank()
        return Stage(ps.get_pipeline_model_parallel_group(), r == 0, r == n - 1,
                     ps.get_pipeline_model_parallel_prev_rank() if r else None,
                     ps.get_pipeline_model_parallel_next_rank() if r < n - 1 else None,
                     ps.get_pipeline_model_parallel_last_rank())


class _Send(torch.autograd.Function):
    @staticmethod
    def forward(ctx, residual, x, dst):
        ctx.dst, ctx.shape, ctx.dtype = dst, residual.shape, residual.dtype
        dist.send(torch.stack([residual, x]).contiguous(), dst)
        return residual.new_empty(0)

    @staticmethod
    def backward(ctx, g):
        buf = torch.empty((2, *ctx.shape), dtype=ctx.dtype, device=g.device)
        dist.recv(buf, ctx.dst)
        return buf[0], buf[1], None


class _Recv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor, shape, dtype, src):
        ctx.src, ctx.shape, ctx.dtype, ctx.device = src, shape, dtype, anchor.device
        buf = torch.empty((2, *shape), dtype=dtype, device=anchor.device)
        dist.recv(buf, src)
        return buf[0].clone(), buf[1].clone()

    @staticmethod
    def backward(ctx, g_residual, g_x):
        zero = lambda g: torch.zeros(ctx.shape, dtype=ctx.dtype, device=ctx.device) if g is None else g.to(ctx.dtype)
        dist.send(torch.stack([zero(g_residual), zero(g_x)]).contiguous(), ctx.src)
        return None, None, None, None


class _FromLast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, shape, stage):
        ctx.last, ctx.tshape = stage.last, t.shape
        buf = t.contiguous().clone() if stage.last else torch.empty(shape, dtype=torch.float32, device=t.device)
        dist.broadcast(buf, stage.src, group=stage.group)
        return buf

    @staticmethod
    def backward(ctx, g):
        return (g if ctx.last else g.new_zeros(ctx.tshape)), None, None


def send(residual, x, stage: Stage):
    """(residual, x) to the next stage; a 0-element token that carries this stage's graph."""
    return _Send.apply(residual, x, stage.next)


def recv(shape, dtype, device, stage: Stage):
    """(residual, x) from the previous stage, each ``shape``; differentiable when grad is enabled."""
    anchor = torch.empty(0, device=device, requires_grad=torch.is_grad_enabled())
    return _Recv.apply(anchor, tuple(shape), dtype, stage.prev)


def from_last(t, shape, stage: Stage):
    """The last stage's fp32 tensor ``t`` (``shape``) on every rank of the pipeline group (other
    stages pass their ``send`` token as ``t``)."""
    return t if stage.group is None else _FromLast.apply(t, tuple(shape), stage)
