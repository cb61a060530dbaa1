"""Runtime policy: check a contract against the resolved SGLang arguments, the environment,
the installed versions and the model, all at once, and fail closed with every violation."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from true_on_policy import env
from true_on_policy.contract import Contract, get_contract
from true_on_policy.redact import redact_text


@dataclass(frozen=True)
class Violation:
    subject: str  # flag, env var, package or "model"
    found: str
    fix: str

    def __str__(self):
        return f"{self.subject}: {self.found} -> {self.fix}"


class PolicyError(ValueError):
    def __init__(self, contract: str, violations: list[Violation]):
        self.contract = contract
        self.violations = list(violations)
        lines = redact_text("\n".join(f"  - {v}" for v in self.violations))
        super().__init__(
            f"true-on-policy contract {contract}: {len(self.violations)} violation(s); "
            f"nothing was started:\n{lines}"
        )


@dataclass(frozen=True)
class RuntimePolicy:
    """What a process enforces: the contract and the role it plays (launcher, engine, scheduler)."""

    contract: Contract
    role: str

    @classmethod
    def from_env(cls, role: str) -> RuntimePolicy:
        from true_on_policy import DEFAULT_CONTRACT

        return cls(get_contract(env.CONTRACT.get() or DEFAULT_CONTRACT), role)


def member(value, allowed) -> bool:
    for a in allowed:
        if a is None or isinstance(a, bool) or isinstance(value, bool):
            if value is a:
                return True
        elif value == a:
            return True
    return False


def check_args(contract: Contract, server_args) -> list[Violation]:
    out = []
    for rule in contract.args:
        if not hasattr(server_args, rule.dest):
            out.append(Violation(rule.flag, f"ServerArgs has no field {rule.dest!r}",
                                 "install sglang==0.5.17"))
            continue
        value = getattr(server_args, rule.dest)
        if not member(value, rule.allowed):
            fix = (f"the contract forces {rule.force!r}; drop your value" if rule.forced
                   else f"allowed: {', '.join(map(repr, rule.allowed))}; instead: {rule.alternative}")
            out.append(Violation(rule.flag, f"{value!r} ({rule.why})", fix + _elsewhere(contract, rule, value)))
    chunk = getattr(server_args, "chunked_prefill_size", None)
    if isinstance(chunk, int) and chunk not in (-1, 0) and (chunk < 64 or chunk % 64):
        out.append(Violation("--chunked-prefill-size", f"{chunk} (prefill chunks are aligned to 64 tokens; a smaller "
                             "or unaligned size never schedules a long prompt)", "-1 or a multiple of 64"))
    tp, ep = getattr(server_args, "tp_size", 1), getattr(server_args, "ep_size", 1)
    if isinstance(tp, int) and isinstance(ep, int) and ep > 0 and tp % ep:
        out.append(Violation("--ep-size", f"{ep} does not divide --tp-size {tp}", "choose EP dividing TP"))
    return out + check_tokenizer(server_args)


def check_tokenizer(server_args) -> list[Violation]:
    """The tokenizer SGLang will load is on disk (``model_check.tokenizer_problem``), unless
    ``--skip-tokenizer-init``: refused before the weights are loaded, not after."""
    from true_on_policy.contract import model_check

    model = getattr(server_args, "model_path", None)
    if not model or getattr(server_args, "skip_tokenizer_init", False):
        return []
    p = model_check.tokenizer_problem(str(model), getattr(server_args, "tokenizer_path", None))
    return [] if p is None else [Violation(p.subject, p.found, p.fix)]


def _elsewhere(contract: Contract, rule, value) -> str:
    """The registered contracts whose rule for the same argument allows ``value`` (a refusal names
    where the value is served: PP > 1 is refused by v1 and routed by the TP preview), unless the
    rule's own alternative already names them."""
    from true_on_policy.contract import known_contracts

    names = [name for name in known_contracts() if name != contract.name and name not in rule.alternative
             and any(r.dest == rule.dest and member(value, r.allowed) for r in get_contract(name).args)]
    if not names:
        return ""
    return (f"; or --true-on-policy-contract {' / '.join(names)}, which allows {rule.flag} {value!r} "
            "(the trainer must load the same contract)")


def check_resolved(contract: Contract, server_args) -> list[Violation]:
    """Rules on SGLang's *resolved* arguments only (its resolution sets what they check): at an
    allowed pp > 1 the overlap schedule must be off (SGLang's ``check_server_args`` asserts it);
    the CUDA-graph backend each phase resolved to is one the contract allows (see ``graph_backends``)."""
    out = []
    pp = getattr(server_args, "pp_size", 1)
    allowed = any(r.dest == "pp_size" and member(pp, r.allowed) for r in contract.args)
    if isinstance(pp, int) and pp > 1 and allowed and getattr(server_args, "disable_overlap_schedule", None) is not True:
        out.append(Violation("--disable-overlap-schedule", f"off at --pp-size {pp} (SGLang's pipeline scheduler has "
                             "no overlap mode; its check_server_args refuses the pair)", "pass --disable-overlap-schedule"))
    return out + check_graph_backends(contract, server_args) + check_model_source(server_args)


LOAD_FORMATS = ("auto", "safetensors", "pt")  # the checkpoint's own bf16 tensors, as the trainer loads them
MODEL_IMPLS = ("auto", "sglang")  # the overlay patches SGLang's own Qwen3-MoE classes


def check_model_source(server_args) -> list[Violation]:
    """The model SGLang builds must be the checkpoint the trainer loads: its config.json unchanged
    (``--json-model-override-args``), its weights as stored (``--load-format``: dummy draws random
    ones, gguf and bitsandbytes quantise), and SGLang's own Qwen3-MoE classes, the ones the overlay
    patches (``--model-impl``). Not contract data: no fingerprint depends on these."""
    out = []
    override = getattr(server_args, "json_model_override_args", None)
    try:
        overridden = bool(json.loads(override)) if isinstance(override, str) and override.strip() else bool(override)
    except json.JSONDecodeError:
        overridden = True
    if overridden:
        out.append(Violation("--json-model-override-args", f"{override!r} (the rollout's model config would differ "
                             "from the checkpoint's config.json, which the trainer loads)",
                             "drop it; change config.json in a copy of the checkpoint and point both sides at it"))
    fmt = getattr(server_args, "load_format", "auto")
    if fmt not in LOAD_FORMATS:
        out.append(Violation("--load-format", f"{fmt!r} (not the checkpoint's stored tensors as the trainer loads "
                             "them: dummy weights are random, gguf / bitsandbytes quantised)",
                             f"one of {', '.join(LOAD_FORMATS)} (auto: the default)"))
    impl = getattr(server_args, "model_impl", "auto")
    if impl not in MODEL_IMPLS:
        out.append(Violation("--model-impl", f"{impl!r} (the overlay patches SGLang's own Qwen3-MoE implementation; "
                             "another would run unpatched kernels)", "auto (the default) or sglang"))
    return out


def graph_backends(contract: Contract) -> dict[str, tuple]:
    """Per phase, the CUDA-graph backends a run under ``contract`` may resolve to: the values its
    ``cuda_graph_backend_<phase>`` rule allows (None there is SGLang's default, which resolution
    turns into one of them), and "disabled" (graphs off: the eager path every graph is held to)."""
    out = {}
    for phase in ("decode", "prefill"):
        rule = next((r for r in contract.args if r.dest == f"cuda_graph_backend_{phase}"), None)
        if rule is not None:
            out[phase] = tuple(dict.fromkeys([*(str(v) for v in rule.allowed if v is not None), "disabled"]))
    return out


def resolved_graph_backends(server_args) -> dict:
    """The CUDA-graph backend SGLang resolved for each phase (None: not resolved, as in an
    unresolved namespace)."""
    config = getattr(server_args, "cuda_graph_config", None)
    out = {}
    for phase in ("decode", "prefill"):
        backend = getattr(getattr(config, phase, None), "backend", None)
        out[phase] = None if backend is None else str(getattr(backend, "value", backend))
    return out


def check_graph_backends(contract: Contract, server_args) -> list[Violation]:
    """SGLang resolves the graph backend of each phase from several flags, and ``--cuda-graph-config``
    JSON wins over the per-phase ones the contract's rules read: judge what it resolved to."""
    resolved = resolved_graph_backends(server_args)
    out = []
    for phase, allowed in graph_backends(contract).items():
        value = resolved[phase]
        if value is None:
            continue  # not resolved (an unresolved namespace): the per-phase rules judged it
        if value not in allowed:
            out.append(Violation("--cuda-graph-config", f"the {phase} CUDA graphs resolved to {value!r} (the contract "
                                 f"allows {', '.join(allowed)} for {phase})",
                                 f"drop the {phase} backend from --cuda-graph-config (or give one of those)"))
    return out


def check_env(contract: Contract, environ=None) -> list[Violation]:
    environ = os.environ if environ is None else environ
    out = []
    for rule in contract.env:
        have = environ.get(rule.name)
        if have is None:
            continue
        if rule.value is not None and have != rule.value:
            out.append(Violation(rule.name, f"set to {have!r}",
                                 f"unset it (the launcher sets {rule.value!r}: {env.REQUIRED_WHY[rule.name]})"))
        elif rule.value is None and have not in rule.allowed:
            out.append(Violation(rule.name, f"set to {have!r}", f"unset it ({env.REQUIRED_WHY[rule.name]})"))
    plugins = environ.get(env.SGLANG_PLUGINS.name)
    if plugins and env.PLUGIN_ENTRY_POINT not in {p.strip() for p in plugins.split(",")}:
        out.append(Violation(env.SGLANG_PLUGINS.name, f"{plugins!r} does not list {env.PLUGIN_ENTRY_POINT!r}",
                             f"add {env.PLUGIN_ENTRY_POINT} or unset it (else schedulers skip the overlay)"))
    return out


def _installed(dist: str) -> str | None:
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def check_versions(contract: Contract, installed=_installed) -> list[Violation]:
    out = []
    for dist, want in contract.versions:
        have = installed(dist)
        if have is None or have.split("+")[0] != want:
            out.append(Violation(dist, f"{have or 'not installed'}", f"install {dist}=={want}"))
    return out


PLUGIN = ("true_on_policy", "true_on_policy.plugin:register")  # (name, value) of our sglang.srt.plugins entry


def check_plugin(entry_points=None) -> list[Violation]:
    """SGLang patches its scheduler processes by loading the ``sglang.srt.plugins`` entry points
    there; with the package importable but not installed (``PYTHONPATH`` only), those processes
    would run stock kernels under a true-on-policy launch. Refused before anything starts."""
    if entry_points is None:
        from importlib.metadata import entry_points
    found = [e.value for e in entry_points(group="sglang.srt.plugins") if e.name == PLUGIN[0]]
    if found == [PLUGIN[1]]:
        return []
    what = (f"the sglang.srt.plugins entry point {PLUGIN[0]!r} is not installed: SGLang's scheduler processes "
            "would run unpatched" if not found else
            f"the sglang.srt.plugins entry point {PLUGIN[0]!r} is {found}, not [{PLUGIN[1]!r}] (another install)")
    return [Violation("true_on_policy plugin", what, "install this checkout: pip install -e . (on a host without a "
                      "package index: bash tests/gpu/dev_install.sh)")]


def read_architectures(model_path: str) -> list[str]:
    cfg = Path(model_path) / "config.json"
    if cfg.is_file():
        return list(json.loads(cfg.read_text()).get("architectures") or [])
    from transformers import AutoConfig  # a hub id: only what is already in the local cache

    return list(AutoConfig.from_pretrained(model_path, local_files_only=True).architectures or [])


def check_model(contract: Contract, model_path: str | None, tp_size: int = 1, ep_size: int = 1, pp_size: int = 1,
                partition: str | None = None) -> list[Violation]:
    """The checkpoint at ``model_path`` under the contract and the rollout layout (TP, EP, PP and the
    ``SGLANG_PP_LAYER_PARTITION`` text): one violation per problem (``true_on_policy.contract.model_check``,
    shared with the engine and the trainer)."""
    return [Violation(p.subject, p.found, p.fix)
            for p in model_problems(contract, model_path, tp_size, ep_size, pp_size, partition)[1]]


def model_problems(contract: Contract, model_path: str | None, tp_size: int = 1, ep_size: int = 1, pp_size: int = 1,
                   partition: str | None = None):
    """``(config or None, problems)``; the config is None when the checkpoint cannot be read."""
    from true_on_policy.contract import model_check

    if not model_path:
        return None, [model_check.ModelProblem("--model-path", "missing", "pass a Qwen3-MoE checkpoint folder or "
                                               "omit it for the embedded one")]
    return model_check.check_checkpoint(str(model_path), contract.architectures, tp_size, ep_size, pp_size, partition)


def check_all(contract: Contract, server_args, environ=None, installed=_installed) -> list[Violation]:
    environ = os.environ if environ is None else environ
    return (check_versions(contract, installed) + check_env(contract, environ)
            + check_model(contract, getattr(server_args, "model_path", None),
                          getattr(server_args, "tp_size", 1), getattr(server_args, "ep_size", 1),
                          getattr(server_args, "pp_size", 1), environ.get(env.PP_LAYER_PARTITION.name))
            + check_args(contract, server_args) + check_resolved(contract, server_args))


def validate(contract: Contract, server_args, environ=None) -> None:
    violations = check_all(contract, server_args, environ)
    if violations:
        raise PolicyError(contract.name, violations)
