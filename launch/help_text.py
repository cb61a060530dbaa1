"""``python -m launch.server --help``: our flags, then SGLang's own help, without building anything.

SGLang's help is its parser's (``ServerArgs.add_cli_args``), and building that parser imports
SGLang, torch and transformers. The rendered text depends only on the installed SGLang source,
the ``SGLANG_*`` environment and the terminal width, so it is kept in the overlay's cache folder
under a key of exactly those (every ``.py`` file of the installed ``sglang`` package by path,
size and modification time): the first ``--help`` renders it, later ones read it, and any change
to SGLang renders it afresh. Under the overlay ``--model-path`` is optional (omitted: the
embedded checkpoint), so the help shows it as optional and says so.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
import textwrap
from importlib.metadata import version
from pathlib import Path

FORMAT = 1  # bump when what the cached text holds changes (our edits to SGLang's parser below)

OWN_HELP = """\
true-on-policy overlay (python -m launch.server): our flags, then SGLang's own (below).

  --true-on-policy                  turn the overlay on; without it this is exactly
                                    python -m sglang.launch_server
  --true-on-policy-contract NAME    the contract to enforce (default {default});
{known}
  --dry-run                         with --true-on-policy: validate the plan (flags, environment,
                                    versions, checkpoint), print it as JSON and exit; no GPU needed
  --true-on-policy-keep-manifests   keep the run's manifest folder after exit (default: removed;
                                    also TRUE_ON_POLICY_KEEP_MANIFESTS=1)

  --model-path DIR                  required without --true-on-policy (SGLang's rule); with it,
                                    optional: omitted, the embedded tiny Qwen3-MoE checkpoint is
                                    built and served
"""

MODEL_PATH_NOTE = (" With --true-on-policy: optional; omitted, the overlay serves its embedded tiny "
                   "Qwen3-MoE checkpoint.")


def own_help() -> str:
    from true_on_policy import DEFAULT_CONTRACT
    from true_on_policy.contract import known_contracts

    indent = " " * 36
    known = textwrap.fill("known: " + ", ".join(known_contracts()), 100, initial_indent=indent,
                          subsequent_indent=indent + "  ", break_on_hyphens=False)
    return OWN_HELP.format(default=DEFAULT_CONTRACT, known=known)


def help_key() -> str:
    """What SGLang's rendered help depends on, hashed; reads file metadata only (imports nothing)."""
    spec = importlib.util.find_spec("sglang")  # a top-level package: located, not executed
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("sglang is not installed: pip install sglang==0.5.17")
    root = Path(next(iter(spec.submodule_search_locations)))
    h = hashlib.sha256(f"{FORMAT}|{version('sglang')}|{root}|{shutil.get_terminal_size().columns}".encode())
    for name in sorted(k for k in os.environ if k.startswith("SGLANG")):
        h.update(f"|{name}={os.environ[name]}".encode())
    for folder, dirs, files in os.walk(root):
        dirs.sort()
        for f in sorted(files):
            if f.endswith(".py"):
                st = os.stat(os.path.join(folder, f))
                h.update(f"|{os.path.relpath(os.path.join(folder, f), root)}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def render_sglang_help() -> str:
    """SGLang's parser as the launcher builds it, ``--model-path`` shown as optional."""
    from true_on_policy.contract.launch_plan import sglang_parser

    parser = sglang_parser()
    for action in parser._actions:  # argparse keeps no public handle on an added argument
        if action.dest == "model_path":
            action.required = False
            action.help = (action.help or "").rstrip() + MODEL_PATH_NOTE
    return parser.format_help()


def sglang_help(cache: Path) -> str:
    """SGLang's help text, from ``cache`` when rendered before for this SGLang (see the module docstring)."""
    path = cache / "sglang-help" / f"{help_key()}.txt"
    if path.is_file():
        return path.read_text()
    text = render_sglang_help()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")  # concurrent --help calls: whole files only
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError:  # an unwritable cache folder: the help is still printed, rendered again next time
        pass
    return text
