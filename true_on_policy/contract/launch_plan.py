"""From a contract and the user's SGLang arguments to a validated launch plan — no GPU needed.

``build_plan`` strips nothing (the launcher already removed its own flags); when no ``--model-path``
is given it asks the caller's ``default_model`` for one (the launchers hand down the embedded
checkpoint's builder, ``true_on_policy.tiny_model.ensure``: this layer builds nothing), rejects user values that contradict a
forced argument, appends the forced arguments, lets SGLang resolve the result
(``prepare_server_args``) and validates the *resolved* object, the environment and the
installed versions. The checkpoint is checked first (``true_on_policy.contract.model_check``: readable,
covered, shardable at the requested TP/EP, its layers split over the PP stages (``SGLANG_PP_LAYER_PARTITION``
included); again at the resolved layout); when it is unreadable or
refused, SGLang is not asked to resolve anything and only what can be checked without the model is
added. Every violation is collected before one ``PolicyError`` is raised; a refused plan leaves the
environment as it found it.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass, field

from true_on_policy import env
from true_on_policy.contract import Contract
from true_on_policy.contract.model_check import check_pipeline, check_sharding
from true_on_policy.contract.policy import (
    PolicyError,
    Violation,
    check_args,
    check_env,
    check_plugin,
    check_resolved,
    check_versions,
    member,
    model_problems,
    resolved_graph_backends,
)
from true_on_policy.contract.sglang_refusal import refused_by_sglang
from true_on_policy.redact import redact, redact_text


@dataclass
class LaunchPlan:
    contract: Contract
    argv: list[str]
    forced: dict
    server_args: object
    embedded_model: bool
    env: dict = field(default_factory=dict)

    def to_json_dict(self) -> dict:
        """The plan as printed by ``--dry-run``: every secret replaced by ``<redacted>``."""
        sa = self.server_args
        return redact({
            "contract": self.contract.name,
            "fingerprint": self.contract.fingerprint,
            "argv": self.argv,
            "forced_args": self.forced,
            "env": self.env,
            "model_path": sa.model_path,
            "embedded_model": self.embedded_model,
            "resolved": {r.dest: getattr(sa, r.dest, None) for r in self.contract.args},
            "cuda_graph_backends": resolved_graph_backends(sa),
        })


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # "unrecognized arguments: --api-keyy SECRET" must not print the value
        super().error(redact_text(message))


def sglang_parser() -> argparse.ArgumentParser:
    from sglang.srt.server_args import ServerArgs

    parser = _Parser(prog="python -m launch.server")
    ServerArgs.add_cli_args(parser)
    return parser


def has_model_path(argv: list[str]) -> bool:
    return any(a in ("--model-path", "--model") or a.startswith(("--model-path=", "--model=")) for a in argv)


def forced_argv(contract: Contract) -> tuple[list[str], dict]:
    argv, forced = [], {}
    for rule in contract.args:
        if not rule.forced:
            continue
        forced[rule.flag] = rule.force
        if rule.force is True:
            argv.append(rule.flag)
        elif rule.force is not False and rule.force is not None:
            argv += [rule.flag, str(rule.force)]
    return argv, forced


def user_conflicts(contract: Contract, given: dict, defaults: dict) -> list[Violation]:
    """User values that contradict a forced argument (rejected rather than silently overridden)."""
    out = []
    for rule in contract.args:
        if not rule.forced or rule.dest not in given:
            continue
        mine = given[rule.dest]
        if mine != defaults.get(rule.dest) and not member(mine, rule.allowed):
            out.append(Violation(rule.flag, f"you passed {mine!r}", f"the contract forces {rule.force!r} ({rule.why})"))
    return out


def add_rl_target(name: str) -> None:
    """Make ``name`` (a contract's ``rl_on_policy_target``) one of SGLang's ``--rl-on-policy-target``
    choices, in this process; idempotent."""
    from sglang.srt.server_args import RL_ON_POLICY_TARGET_CHOICES, add_rl_on_policy_target_choices

    if name not in RL_ON_POLICY_TARGET_CHOICES:
        add_rl_on_policy_target_choices([name])


def _default_model(contract: Contract, default_model: Callable[[], str] | None) -> str:
    if default_model is None:
        raise PolicyError(contract.name, [Violation("--model-path", "no checkpoint given",
                                                    "pass --model-path DIR, a downloaded checkpoint folder")])
    return default_model()


def build_plan(contract: Contract, user_argv: list[str], environ=None,
               default_model: Callable[[], str] | None = None) -> LaunchPlan:
    """Plan for the launcher: SGLang command-line arguments in, resolved ServerArgs out.
    ``default_model``: returns the checkpoint to serve when ``user_argv`` has no ``--model-path``
    (None: one is required)."""
    from sglang.srt.server_args import prepare_server_args

    add_rl_target(contract.rl_on_policy_target)
    argv = list(user_argv)
    embedded = not has_model_path(argv)
    if embedded:
        argv += ["--model-path", _default_model(contract, default_model)]
    parser = sglang_parser()
    ns = parser.parse_args(argv)
    conflicts = user_conflicts(contract, vars(ns), vars(parser.parse_args(["--model-path", ns.model_path])))
    extra, forced = forced_argv(contract)
    argv += extra
    server_args = _resolve(contract, ns.model_path, conflicts, environ,
                           lambda: prepare_server_args(argv), lambda: parser.parse_args(argv))
    return LaunchPlan(contract, argv, forced, server_args, embedded, dict(contract.required_env()))


def build_plan_from_kwargs(contract: Contract, kwargs: dict, environ=None,
                           default_model: Callable[[], str] | None = None) -> LaunchPlan:
    """Plan for the Python engine: ``sglang.Engine`` keyword arguments in, resolved ServerArgs out.
    ``default_model``: as for ``build_plan``, when ``kwargs`` has no ``model_path``."""
    from sglang.srt.server_args import ServerArgs

    add_rl_target(contract.rl_on_policy_target)
    kwargs = dict(kwargs)
    embedded = kwargs.get("model_path") is None
    if embedded:
        kwargs["model_path"] = _default_model(contract, default_model)
    defaults = {f: getattr(ServerArgs, f) for f in kwargs if hasattr(ServerArgs, f)}
    conflicts = user_conflicts(contract, kwargs, defaults)
    forced = {r.dest: r.force for r in contract.args if r.forced}
    merged = {**kwargs, **forced}
    server_args = _resolve(contract, kwargs["model_path"], conflicts, environ,
                           lambda: ServerArgs(**merged), lambda: _defaults_with(merged))
    return LaunchPlan(contract, [], forced, server_args, embedded, dict(contract.required_env()))


def _defaults_with(kwargs: dict) -> argparse.Namespace:
    """Unresolved engine arguments as the launcher sees them: SGLang's defaults, then the kwargs."""
    ns = sglang_parser().parse_args(["--model-path", str(kwargs["model_path"])])
    for name, value in kwargs.items():
        setattr(ns, name, value)
    return ns


def _resolve(contract, model_path, conflicts, environ, resolve, unresolved):
    environ = os.environ if environ is None else environ
    ns = unresolved()
    partition = environ.get(env.PP_LAYER_PARTITION.name)
    cfg, model = model_problems(contract, model_path, getattr(ns, "tp_size", 1), getattr(ns, "ep_size", 1),
                                getattr(ns, "pp_size", 1), partition)
    early = check_versions(contract) + check_plugin() + check_env(contract, environ) + violations_of(model)
    if early:  # the model is unreadable or refused: report it with what can be checked without SGLang
        raise PolicyError(contract.name, early + conflicts + check_args(contract, ns))
    saved = env.save()  # SGLang's resolution writes os.environ (NCCL_ALGO at TP > 1): undone on refusal
    try:
        server_args = resolve()
    except Exception as e:  # noqa: BLE001 - SGLang's own refusal, reported with ours
        env.restore_saved(saved)
        raise PolicyError(contract.name, _unique(conflicts + refused_by_sglang(contract, e, ns))) from e
    violations = conflicts + check_args(contract, server_args) + check_resolved(contract, server_args) + violations_of(
        check_sharding(cfg, server_args.tp_size, server_args.ep_size)  # the resolved layout
        + check_pipeline(cfg, server_args.pp_size, partition))
    if violations:
        env.restore_saved(saved)
        raise PolicyError(contract.name, _unique(violations))
    return server_args


def violations_of(problems) -> list[Violation]:
    """``model_check`` problems as the ``Violation`` entries of a ``PolicyError``."""
    return [Violation(p.subject, p.found, p.fix) for p in problems]


def _unique(violations: list[Violation]) -> list[Violation]:
    return list(dict.fromkeys(violations))


def apply_env(plan: LaunchPlan, manifest_dir: str) -> dict[str, str | None]:
    """Export the contract's environment and the overlay switch (inherited by every child).

    Returns the previous values, for ``env.restore``.
    """
    previous = env.apply_required(plan.env)
    for name, value in env.enable_overlay(plan.contract.name, manifest_dir).items():
        previous.setdefault(name, value)
    return previous


def exported_env(plan: LaunchPlan) -> dict[str, str | None]:
    return env.snapshot(list(plan.env) + [env.ENABLED.name, env.CONTRACT.name, env.MANIFEST_DIR.name])
