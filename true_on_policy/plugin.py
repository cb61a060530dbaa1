"""The ``sglang.srt.plugins`` entry point: SGLang calls ``register()`` in every process that
runs ``load_plugins()`` (the launcher/engine parent and each scheduler, spawned).

Inert unless ``SGLANG_TRUE_ON_POLICY=1``; reads no SGLang config here (the scheduler has not
published it yet); idempotent. In a scheduler it applies every patch before the model is built.
In the parent it hooks ``ServerArgs.check_server_args`` so an Engine built with a violating
configuration fails before any process is spawned.

``load_plugins`` logs and swallows ``Exception`` from a plugin, which would leave a scheduler
running stock numerics under a true-on-policy banner. Failures are therefore re-raised as
``OverlayAbort`` (a ``SystemExit``), which it does not swallow: the process stops, loudly.
"""

from __future__ import annotations

import logging
import multiprocessing

from true_on_policy import env

logger = logging.getLogger("true_on_policy")
CHECK_SERVER_ARGS = "sglang.srt.server_args.ServerArgs.check_server_args"


class OverlayAbort(SystemExit):
    pass


def register() -> None:
    if not env.ENABLED.is_true():
        return
    try:
        _register()
    except Exception as e:  # noqa: BLE001 - re-raised past load_plugins' `except Exception`
        from true_on_policy.redact import redact_text

        why = redact_text(str(e))  # an SGLang error may quote the arguments it refused
        logger.critical("true-on-policy overlay failed to load: %s", why)
        raise OverlayAbort(f"true-on-policy overlay failed to load: {why}") from e


def process_role() -> str:
    return "launcher" if multiprocessing.current_process().name == "MainProcess" else "scheduler"


def _register() -> None:
    from true_on_policy.contract.launch_plan import add_rl_target
    from true_on_policy.contract.policy import RuntimePolicy

    policy = RuntimePolicy.from_env(process_role())
    add_rl_target(policy.contract.rl_on_policy_target)
    if policy.role == "scheduler":
        from true_on_policy import patches

        manifest = patches.apply_all(policy)
        for record in manifest.patches:
            for line in record.replacements:
                logger.info("true-on-policy patch %s: %s", record.patch, line)
    else:
        install_main_process(policy)


def install_main_process(policy) -> list:
    """The launching process's patches: argument validation, the per-request contract and the
    per-sample seeds (the tokenizer lives here), and one weight-update payload per (pp, tp) rank
    (``Engine.update_weights_from_tensor``). Idempotent; returns the PatchRecords."""
    from true_on_policy.patches import request_contract, seeds, weight_updates, weights

    install_validation(policy)
    return [request_contract.apply(policy), seeds.apply(policy), weights.apply_main(policy),
            weight_updates.apply_main(policy)]


def install_validation(policy) -> None:
    from true_on_policy.contract.policy import validate
    from true_on_policy.patching import after, wrap

    def _validate(_result, server_args, *args, **kwargs):
        validate(policy.contract, server_args)

    wrap(CHECK_SERVER_ARGS, after(_validate))
