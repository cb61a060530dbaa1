"""``python -m launch.server [--true-on-policy [--true-on-policy-contract NAME] [--dry-run]
[--true-on-policy-keep-manifests]] <sglang flags>``

Thin by design: strip our flags, build and validate the launch plan, export the environment,
add the manifest route, hand the resolved arguments to SGLang's own ``launch_server``. Without
``--true-on-policy`` this is exactly ``python -m sglang.launch_server`` (the overlay is inert).

``-h`` / ``--help`` prints our flags, then SGLang's own help, and exits (building no checkpoint;
SGLang's part is rendered once per SGLang install and cached, ``launch.help_text``). ``--help`` and
``--dry-run`` print none of the platform warnings a host without CUDA gets (``PLATFORM_NOISE``).
Our flags: ``--true-on-policy`` turns the overlay on; ``--true-on-policy-contract NAME`` picks the
contract; ``--dry-run`` prints the validated plan (secrets as ``<redacted>``) and exits;
``--true-on-policy-keep-manifests`` keeps the run's manifest folder after exit (default: removed;
also ``TRUE_ON_POLICY_KEEP_MANIFESTS=1``).
"""

from __future__ import annotations

import json
import logging
import os
import sys

from true_on_policy import DEFAULT_CONTRACT, env

logger = logging.getLogger("true_on_policy")
MANIFEST_ROUTE = "/true_on_policy/manifest"


# What SGLang and torch print on a host without CUDA (no GPU Triton, no AWQ/GGUF kernels, no CUDA
# runtime): platform facts, nothing a --help or --dry-run user can act on. Only such a host prints them.
PLATFORM_NOISE = (
    "Triton is not supported on current platform",
    "Only CUDA, HIP and XPU support AWQ",
    "Only CUDA, MUSA and NPU support GGUF",
    "No CUDA runtime is found",
)


def _not_noise(record: logging.LogRecord) -> bool:
    return not any(text in record.getMessage() for text in PLATFORM_NOISE)


def quiet_platform_noise() -> None:
    """Silence ``PLATFORM_NOISE`` (Python warnings and the torch logger's line) in this process;
    idempotent."""
    import re
    import warnings

    for text in PLATFORM_NOISE:
        warnings.filterwarnings("ignore", message=re.escape(text))
    logging.getLogger("torch.utils.cpp_extension").addFilter(_not_noise)


class UsageError(ValueError):
    """A malformed command line of ours (printed as ``error: ...``, exit 2)."""


def _contract_name(value: str) -> str:
    if not value or value.startswith("-"):
        from true_on_policy.contract import known_contracts

        raise UsageError(f"--true-on-policy-contract needs a contract name (known: {', '.join(known_contracts())})")
    return value


def print_help() -> None:
    """Our flags, then SGLang's own help (``launch.help_text``: rendered once per SGLang install, then
    read from the cache folder); builds no checkpoint, reads no checkpoint."""
    from launch import help_text
    from true_on_policy import tiny_model

    print(help_text.own_help(), flush=True)
    quiet_platform_noise()  # when SGLang's parser has to be built
    print(help_text.sglang_help(tiny_model.cache_root()), end="")


def split_own_flags(argv: list[str]) -> tuple[dict, list[str]]:
    own = {"true_on_policy": False, "contract": DEFAULT_CONTRACT, "dry_run": False, "keep_manifests": False}
    rest, i = [], 0
    while i < len(argv):
        a = argv[i]
        if a == "--true-on-policy":
            own["true_on_policy"] = True
        elif a == "--dry-run":
            own["dry_run"] = True
        elif a == "--true-on-policy-keep-manifests":
            own["keep_manifests"] = True
        elif a == "--true-on-policy-contract":
            own["contract"], i = _contract_name(argv[i + 1] if i + 1 < len(argv) else ""), i + 1
        elif a.startswith("--true-on-policy-contract="):
            own["contract"] = _contract_name(a.split("=", 1)[1])
        else:
            rest.append(a)
        i += 1
    return own, rest


def add_manifest_route(app, contract) -> None:
    """``GET /true_on_policy/manifest`` at SGLang's admin auth level (``AuthLevel.ADMIN_OPTIONAL``,
    read by SGLang's own API-key middleware): the admin key when ``--admin-api-key`` is set, else
    the ``--api-key`` when set, else open. The manifests are redacted where they are written."""
    from sglang.srt.utils.auth import AuthLevel, auth_level

    from true_on_policy import manifest

    @auth_level(AuthLevel.ADMIN_OPTIONAL)
    async def true_on_policy_manifest():
        return {"contract": contract.name, "fingerprint": contract.fingerprint,
                "manifests": manifest.read_all()}

    app.add_api_route(MANIFEST_ROUTE, true_on_policy_manifest, methods=["GET"])


def _verifier(contract, server_args, folder):
    from sglang.srt.utils import kill_process_tree

    from true_on_policy import manifest

    def verify() -> bool:
        expected = server_args.tp_size * server_args.pp_size
        problems = manifest.check_schedulers(manifest.read_all(folder), expected, contract.fingerprint)
        for p in problems:
            logger.error("true-on-policy: %s", p)
        if problems:
            kill_process_tree(os.getpid())
            return False
        logger.info("true-on-policy: %d scheduler manifest(s) verified (%s) in %s", expected,
                    contract.fingerprint[:12], folder)
        return True

    return verify


def run_true_on_policy(plan, keep_manifests: bool = False) -> None:
    from sglang.srt.entrypoints import http_server
    from sglang.srt.utils import kill_process_tree

    from true_on_policy import manifest, reaper
    from true_on_policy.contract.launch_plan import apply_env, exported_env
    from true_on_policy.manifest import Manifest

    keep = keep_manifests or env.KEEP_MANIFESTS.is_true()
    folder = manifest.new_run_dir()
    try:  # --use-ray is refused by the contract (Ray's scheduler actors never load plugins)
        if not keep:  # SGLang's shutdown SIGKILLs this process: the finally below may never run
            reaper.watch(folder)
        apply_env(plan, folder)
        Manifest(role="launcher", contract=plan.contract.name, fingerprint=plan.contract.fingerprint,
                 env_set=exported_env(plan), extra={"argv": plan.argv}).write(folder)
        add_manifest_route(http_server.app, plan.contract)
        verify = _verifier(plan.contract, plan.server_args, folder)
        warmup = http_server._execute_server_warmup
        http_server.launch_server(
            plan.server_args,
            execute_warmup_func=lambda sa: verify() and warmup(sa),
            launch_callback=verify if plan.server_args.skip_server_warmup else None,
        )
    finally:
        kill_process_tree(os.getpid(), include_parent=False)
        manifest.remove_run_dir(folder, keep=keep)


def run_stock(argv: list[str]) -> None:
    from sglang.launch_server import run_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    env.disable_overlay()  # stock means stock, whatever the shell exported
    load_plugins()
    server_args = prepare_server_args(argv)
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print_help()
        return 0
    try:
        own, rest = split_own_flags(argv)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not own["true_on_policy"]:
        if own["dry_run"]:
            print("error: --dry-run checks a true-on-policy plan; add --true-on-policy", file=sys.stderr)
            return 2
        run_stock(rest)
        return 0
    from true_on_policy import tiny_model
    from true_on_policy.contract import UnknownContractError, get_contract
    from true_on_policy.contract.launch_plan import build_plan
    from true_on_policy.contract.policy import PolicyError

    quiet_platform_noise()  # printed only where there is no GPU: the dry run's host, or a refused launch
    try:
        contract = get_contract(own["contract"])
        plan = build_plan(contract, rest, default_model=tiny_model.ensure)  # no --model-path: the embedded model
    except (UnknownContractError, PolicyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if own["dry_run"]:
        print(json.dumps(plan.to_json_dict(), indent=2, sort_keys=True, default=str))
        return 0
    if not cuda_available():
        print("error: --true-on-policy needs an NVIDIA GPU with CUDA; none is visible here "
              "(use --dry-run to check a configuration without one)", file=sys.stderr)
        return 1
    run_true_on_policy(plan, keep_manifests=own["keep_manifests"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
