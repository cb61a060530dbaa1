"""In-process (and Ray-actor) entry: ``sglang.Engine`` with a true-on-policy contract enforced.

Importing this module needs neither a GPU nor SGLang; constructing the engine validates the
configuration first (``PolicyError`` listing every violation, model included, before any GPU work),
raises ``NoGPUError`` on a machine without a CUDA GPU (before any folder or process exists), exports
the contract's environment, starts SGLang and checks that every scheduler process loaded the
overlay under the same contract fingerprint. A refused or failed start leaves ``os.environ`` as it
found it.

    from true_on_policy.rollout.engine import TrueOnPolicyEngine
    with TrueOnPolicyEngine(model_path=..., tp_size=1) as eng:
        out = eng.generate(input_ids=[[1, 2, 3]], sampling_params={"temperature": 1.0})
        eng.manifests()

The manifests live in a private folder (``manifest_dir``, mode 0700) that ``shutdown`` -- and a
refused or failed start -- removes, as does a detached watcher if this process dies first
(``true_on_policy.reaper``); ``keep_manifests=True`` or ``TRUE_ON_POLICY_KEEP_MANIFESTS=1`` keeps it.
"""

from __future__ import annotations

from true_on_policy import DEFAULT_CONTRACT, env

NO_GPU = ("TrueOnPolicyEngine needs an NVIDIA GPU with CUDA; none is visible here, so nothing was started "
          "(check a configuration without one: python -m launch.server --true-on-policy --dry-run <flags>)")


class NoGPUError(RuntimeError):
    """Raised by ``TrueOnPolicyEngine`` on a machine without a CUDA GPU, before anything starts."""


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


class TrueOnPolicyEngine:
    def __init__(self, *, contract: str = DEFAULT_CONTRACT, keep_manifests: bool = False, **sglang_kwargs):
        from true_on_policy import manifest, reaper, tiny_model
        from true_on_policy.contract import get_contract
        from true_on_policy.contract.launch_plan import apply_env, build_plan_from_kwargs, exported_env

        saved = env.save()  # every failure below leaves the caller's environment as it was
        self.keep_manifests = keep_manifests or env.KEEP_MANIFESTS.is_true()
        self.engine, self._previous_env, self.manifest_dir = None, {}, None
        try:
            self.contract = get_contract(contract)
            sglang_kwargs.setdefault("log_level", "error")
            self.plan = build_plan_from_kwargs(self.contract, sglang_kwargs, default_model=tiny_model.ensure)
            if not cuda_available():  # SGLang would start and take this interpreter down with it
                raise NoGPUError(NO_GPU)
            self.manifest_dir = manifest.new_run_dir()
            if not self.keep_manifests:
                reaper.watch(self.manifest_dir)
            self._previous_env = apply_env(self.plan, self.manifest_dir)
            manifest.Manifest(role="engine", contract=self.contract.name, fingerprint=self.contract.fingerprint,
                              env_set=exported_env(self.plan)).write(self.manifest_dir)
            import sglang

            self.engine = sglang.Engine(server_args=self.plan.server_args)
            sa = self.plan.server_args
            problems = manifest.check_schedulers(self.manifests(), sa.tp_size * sa.pp_size, self.contract.fingerprint)
            if problems:
                raise RuntimeError("true-on-policy engine refused: " + "; ".join(problems))
        except BaseException:
            try:
                self.shutdown()
            finally:
                env.restore_saved(saved)
            raise

    @property
    def server_args(self):
        return self.plan.server_args

    def generate(self, prompt=None, sampling_params=None, input_ids=None, return_logprob: bool = True, **kwargs):
        """``sglang.Engine.generate`` with ``return_logprob`` on by default."""
        return self.engine.generate(prompt=prompt, sampling_params=sampling_params, input_ids=input_ids,
                                    return_logprob=return_logprob, **kwargs)

    def flush_cache(self):
        """``sglang.Engine.flush_cache``: empty the prefix (radix) cache; refused (``success``
        False) while requests are in flight."""
        return self.engine.flush_cache()

    def start_profile(self, **kwargs):
        """``sglang.Engine.start_profile``: SGLang's torch profiler in the scheduler (the fields of
        its ``ProfileReq``: output_dir, num_steps, activities, ...)."""
        return self.engine.start_profile(**kwargs)

    def get_server_info(self) -> dict:
        """``sglang.Engine.get_server_info``: resolved arguments, KV-cache size, internal states."""
        return self.engine.get_server_info()

    def manifests(self) -> list[dict]:
        from true_on_policy import manifest

        return manifest.read_all(self.manifest_dir)

    def shutdown(self) -> None:
        """Stop SGLang, restore the environment, remove the manifest folder (unless kept). Idempotent."""
        from true_on_policy import manifest

        try:
            if self.engine is not None:
                engine, self.engine = self.engine, None
                engine.shutdown()
        finally:
            env.restore(self._previous_env)
            self._previous_env = {}
            manifest.remove_run_dir(self.manifest_dir, keep=self.keep_manifests)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
        return False
