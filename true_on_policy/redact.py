"""One redaction rule for everything the overlay writes or serves (plans, manifests, the HTTP
manifest route, evidence files, log lines).

A value is secret when its *name* -- an SGLang argument, a command-line flag, an environment
variable or a JSON key -- holds one of the words in ``SECRET_WORDS`` (split on ``-``, ``_``, ``.``
and camelCase: ``api_key``, ``--admin-api-key``, ``HF_TOKEN``, ``AWS_SECRET_ACCESS_KEY``,
``--ssl-keyfile-password``), or is one of ``SECRET_NAMES``. Secret values print as
``<redacted>``; a secret that was not set (None, False, empty) stays as it was, so the fact that
a key *was* set survives and the fact that it was not does too. Independently of names, the
password (and a token-like user) of any URL with credentials (``scheme://user:pass@host``) is
replaced, in any string.

Whole words only, on purpose: ``--max-total-tokens``, ``--tokenizer-path`` and
``--kv-cache-dtype`` stay readable.

Apply ``redact`` where a record is built (``LaunchPlan.to_json_dict``, ``Manifest.to_dict``,
``provenance.write_evidence``), never at each printer.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

REDACTED = "<redacted>"
SECRET_WORDS = frozenset({"key", "keys", "apikey", "token", "secret", "secrets", "password", "passwords",
                          "passwd", "credential", "credentials"})
SECRET_NAMES = frozenset({"api_key", "admin_api_key"})  # SGLang's own (also caught by the words)

_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")
_URL_CRED = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*://)(?P<user>[^\s/:@]*)(?::(?P<pw>[^\s/@]*))?@")
# --flag=value or --flag value inside one command-line string
_FLAG_IN_TEXT = re.compile(r"(?P<flag>--?[A-Za-z0-9][A-Za-z0-9_.\-]*)(?P<sep>=|\s+)(?P<value>\"[^\"]*\"|'[^']*'|\S+)")
# NAME=value inside a string (an env assignment on a command line)
_ASSIGN_IN_TEXT = re.compile(r"(?<![\w-])(?P<name>[A-Za-z_][A-Za-z0-9_]*)=(?P<value>\"[^\"]*\"|'[^']*'|\S+)")


def words(name: str) -> list[str]:
    name = _CAMEL.sub("_", str(name).lstrip("-"))
    return [w for w in re.split(r"[-_.\s]+", name.lower()) if w]


def is_secret_name(name) -> bool:
    if not isinstance(name, str):
        return False
    canon = name.lstrip("-").replace("-", "_").lower()
    return canon in SECRET_NAMES or any(w in SECRET_WORDS for w in words(name))


def _unset(value) -> bool:
    return value is None or value is False or value == "" or value == [] or value == ()


def redact_value(value):
    """The printed form of a secret's value: kept if unset, else ``<redacted>``."""
    return value if _unset(value) else REDACTED


def redact_text(text: str) -> str:
    """A free-form string (a command line, a URL, a log line): URL passwords, ``--secret-flag
    value`` / ``--secret-flag=value`` and ``SECRET_NAME=value`` replaced."""
    if not isinstance(text, str) or not text:
        return text

    def _url(m):
        user = m.group("user")
        if m.group("pw") is None:  # scheme://token@host: the user part is the credential
            return f"{m.group('scheme')}{REDACTED}@" if user else m.group(0)
        return f"{m.group('scheme')}{user}:{REDACTED}@"

    out = _URL_CRED.sub(_url, text)
    out = _FLAG_IN_TEXT.sub(lambda m: (f"{m.group('flag')}{m.group('sep')}{REDACTED}"
                                       if is_secret_name(m.group("flag")) and not m.group("value").startswith("-")
                                       else m.group(0)), out)
    return _ASSIGN_IN_TEXT.sub(lambda m: f"{m.group('name')}={REDACTED}" if is_secret_name(m.group("name"))
                               else m.group(0), out)


def redact_argv(argv) -> list:
    """A command line as a list: the value after a secret flag (or after ``=``) is replaced."""
    out, hide_next = [], False
    for a in argv:
        a = str(a)
        if hide_next and not a.startswith("--"):
            out.append(REDACTED)
            hide_next = False
            continue
        hide_next = False
        if a.startswith("-") and "=" in a:
            flag, _ = a.split("=", 1)
            out.append(f"{flag}={REDACTED}" if is_secret_name(flag) else redact_text(a))
        elif a.startswith("-") and is_secret_name(a):
            out.append(a)
            hide_next = True
        else:
            out.append(redact_text(a))
    return out


def _looks_like_argv(seq) -> bool:
    return bool(seq) and all(isinstance(a, str) for a in seq) and any(a.startswith("-") for a in seq)


def redact(obj):
    """A deep copy of ``obj`` (dicts, lists, tuples, strings, scalars) with every secret replaced.
    Mapping values under a secret name, argv-shaped lists and URL credentials anywhere."""
    if isinstance(obj, Mapping):
        return {k: (redact_value(v) if is_secret_name(k) and not isinstance(v, Mapping) else redact(v))
                for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        if _looks_like_argv(obj):
            return type(obj)(redact_argv(obj)) if isinstance(obj, tuple) else redact_argv(obj)
        return type(obj)(redact(v) for v in obj)
    if isinstance(obj, str):
        return redact_text(obj)
    return obj


def redact_server_args(server_args) -> dict:
    """Every field of a resolved SGLang ``ServerArgs`` (a dataclass), redacted."""
    from dataclasses import fields, is_dataclass

    if not is_dataclass(server_args):
        return redact(dict(vars(server_args)))
    return redact({f.name: getattr(server_args, f.name, None) for f in fields(server_args)})
