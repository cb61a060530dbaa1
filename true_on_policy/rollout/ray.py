"""A Ray rollout actor: ``TrueOnPolicyEngine`` on the GPUs of a Ray actor or placement-group bundle.

    import ray
    from true_on_policy.rollout.ray import RolloutEngine
    from true_on_policy.trainer import check_rollout

    Actor = RolloutEngine.remote_class(num_gpus=1)               # runtime_env carries the contract's env
    eng = Actor.remote(model_path="/ckpt", mem_fraction_static=0.5)
    check_rollout(eng, model)                                      # the handshake, before the first step
    out = ray.get(eng.generate.remote(input_ids=[[1, 2, 3]], sampling_params={"max_new_tokens": 8}))
    out[0]["output_ids"], out[0]["logprobs"], out[0]["sampling_seed"]
    ray.get(eng.update_weights_from_tensor.remote(ipc_named_tensors(model.named_parameters())))

Inside the actor, ``sglang.Engine`` spawns its scheduler processes with multiprocessing, and every
one of them loads the plugin through SGLang's ``load_plugins()`` (the actor's own process plays the
launcher); ``TrueOnPolicyEngine`` refuses to start unless every scheduler wrote a manifest under the
contract's fingerprint. SGLang's own ``--use-ray`` (``RayEngine``) stays refused by the contract:
its ``SchedulerActor`` builds the scheduler without ``load_plugins()`` (see README, *Ray*).

Weight sync forwards to ``sglang.Engine`` (same signatures as sglang 0.5.17) and raises
``WeightSyncError`` when SGLang reports a failure. SGLang loads new weights into the existing
parameter tensors (``load_weights`` copies in place), so CUDA graphs captured at start keep
reading them; ``tests/gpu/test_ray_gpu.py`` checks graph == eager == trainer after updates.

Importing this module needs Ray (the ``ray`` extra) but no GPU.
"""

from __future__ import annotations

from true_on_policy import DEFAULT_CONTRACT, env
from true_on_policy.rollout.actor import (
    PlacementError,
    WeightSyncError,
    actor_env_problems,
    base_gpu_id,
    checked,
    ipc_named_tensors,
    runtime_env,
    samples,
    weights_checksum,
)

_EXTRA = "pip install ray==2.60.0"  # the version of the package's `ray` extra; works outside a checkout too

try:
    import ray
except ImportError as e:  # the message names the command that installs it
    raise ImportError(f"true_on_policy.rollout.ray needs Ray, which is not installed: {_EXTRA}") from e

__all__ = ["RolloutEngine", "PlacementError", "WeightSyncError", "ipc_named_tensors", "runtime_env"]


class RolloutEngine:
    """One true-on-policy SGLang engine in a Ray actor. Use ``RolloutEngine.remote_class(...)`` (or
    ``ray.remote(RolloutEngine).options(runtime_env=runtime_env(contract))``): the actor refuses to
    start without the contract's environment in its process."""

    def __init__(self, *, contract: str = DEFAULT_CONTRACT, keep_manifests: bool = False, **sglang_kwargs):
        import os

        from true_on_policy.contract import get_contract
        from true_on_policy.rollout.engine import TrueOnPolicyEngine

        c = get_contract(contract)
        problems = actor_env_problems(c, os.environ)
        if problems:
            raise RuntimeError("RolloutEngine: this actor was not started with the contract's runtime_env "
                               "(RolloutEngine.remote_class(...), or options(runtime_env=true_on_policy.rollout.ray."
                               f"runtime_env(get_contract({contract!r})))): " + "; ".join(problems))
        needed = int(sglang_kwargs.get("tp_size", 1)) * int(sglang_kwargs.get("pp_size", 1))
        sglang_kwargs["base_gpu_id"] = base_gpu_id(
            ray.get_gpu_ids(), needed, visible=env.CUDA_VISIBLE_DEVICES.get(), noset=env.RAY_NOSET_CUDA.is_true(),
            requested=sglang_kwargs.get("base_gpu_id"))
        self.engine = TrueOnPolicyEngine(contract=contract, keep_manifests=keep_manifests, **sglang_kwargs)

    @classmethod
    def remote_class(cls, *, contract: str = DEFAULT_CONTRACT, num_gpus: float = 1, num_cpus: float = 1,
                     runtime_env_base: dict | None = None, noset_cuda_visible_devices: bool = False, **options):
        """``ray.remote(RolloutEngine)`` with the contract's ``runtime_env`` (merged into
        ``runtime_env_base``) and the given resources; ``options`` go to ``.options`` (e.g.
        ``scheduling_strategy=PlacementGroupSchedulingStrategy(pg, bundle_index)``). Pass the same
        ``contract`` to ``.remote(contract=...)`` when it is not the default."""
        from true_on_policy.contract import get_contract

        renv = runtime_env(get_contract(contract), runtime_env_base, noset_cuda_visible_devices)
        return ray.remote(cls).options(num_gpus=num_gpus, num_cpus=num_cpus, runtime_env=renv, **options)

    # --- rollout ------------------------------------------------------------------------------
    def generate(self, input_ids=None, sampling_params=None, prompt=None, **kwargs) -> list[dict]:
        """One record per sample (``true_on_policy.rollout.actor.samples``): ``output_ids``, ``logprobs``
        (the contract's), ``sampling_seed``, ``sampling_params_used``, ``finish_reason``, ``meta_info``."""
        kwargs["return_logprob"] = True
        return samples(self.engine.generate(prompt=prompt, sampling_params=sampling_params, input_ids=input_ids,
                                            **kwargs))

    def manifests(self) -> list[dict]:
        return self.engine.manifests()

    def manifest(self) -> dict:
        """The contract, its fingerprint and every process's manifest (the HTTP route's document)."""
        c = self.engine.contract
        return {"contract": c.name, "fingerprint": c.fingerprint, "manifests": self.manifests()}

    def fingerprint(self) -> str:
        return self.engine.contract.fingerprint

    def gpu_ids(self) -> list:
        """``ray.get_gpu_ids()`` of this actor (physical ids, or the node's CUDA_VISIBLE_DEVICES entries)."""
        return ray.get_gpu_ids()

    def server_args(self) -> dict:
        import dataclasses

        return dataclasses.asdict(self.engine.server_args)

    # --- weight sync (sglang.Engine's signatures) -------------------------------------------------
    def update_weights_from_tensor(self, named_tensors, load_format: str | None = None, flush_cache: bool = True):
        """``named_tensors``: HF parameter names with tensors, or ``ipc_named_tensors(...)`` (CUDA IPC)."""
        return checked(self.engine.engine.update_weights_from_tensor(named_tensors, load_format=load_format,
                                                                     flush_cache=flush_cache),
                       "update_weights_from_tensor")

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str, backend: str = "nccl"):
        return checked(self.engine.engine.init_weights_update_group(master_address, master_port, rank_offset,
                                                                    world_size, group_name, backend=backend),
                       "init_weights_update_group")

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str = "weight_update_group", flush_cache: bool = True,
                                        load_format: str | None = None):
        return checked(self.engine.engine.update_weights_from_distributed(
            names, dtypes, shapes, group_name=group_name, flush_cache=flush_cache, load_format=load_format),
            "update_weights_from_distributed")

    def destroy_weights_update_group(self, group_name: str):
        return checked(self.engine.engine.destroy_weights_update_group(group_name), "destroy_weights_update_group")

    def update_weights_from_disk(self, model_path: str, load_format: str | None = None):
        """Reload from ``model_path``, after the same model check as at start (refused: nothing changes)."""
        from true_on_policy.contract.launch_plan import violations_of
        from true_on_policy.contract.policy import PolicyError, model_problems

        sa = self.engine.server_args
        _, problems = model_problems(self.engine.contract, model_path, sa.tp_size, sa.ep_size)
        if problems:
            raise PolicyError(self.engine.contract.name, violations_of(problems))
        return checked(self.engine.engine.update_weights_from_disk(model_path, load_format=load_format),
                       "update_weights_from_disk")

    # --- colocation: SGLang's memory saver (start the actor with enable_memory_saver=True) ----------
    def release_memory_occupation(self, tags: list[str] | None = None):
        """Free the GPU memory of ``tags`` (None: KV cache, weights and CUDA graphs) while the engine
        is idle. Without ``enable_weights_cpu_backup`` the weights hold no values after the resume
        until an update rewrites all of them (``harness/colocated.py`` pushes every step)."""
        return self.engine.engine.release_memory_occupation(tags)

    def resume_memory_occupation(self, tags: list[str] | None = None):
        return self.engine.engine.resume_memory_occupation(tags)

    def weights_checksum(self) -> str:
        """A checksum of every weight the engine holds (``true_on_policy.rollout.actor.weights_checksum``):
        it changes iff an update changed a bit of a weight."""
        return weights_checksum(self.engine.engine)

    def get_weights_by_name(self, name: str, truncate_size: int = 100):
        return self.engine.engine.get_weights_by_name(name, truncate_size)

    def flush_cache(self):
        return self.engine.engine.flush_cache()

    def shutdown(self) -> None:
        self.engine.shutdown()
