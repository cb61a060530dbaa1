"""One redaction rule for everything the overlay writes or serves (plans, manifests, the HTTP
manifest route, evidence files, log lines).

A value is secret when its *name* -- an SGLang argument, a command-line flag, an environment
variable or a JSON key -- holds one of the words in ``SECRET_WORDS`` (secret, password,
credential; split on ``-``, ``_``, ``.`` and camelCase), ends with key or token (``api_key``,
``--admin-api-key``, ``HF_TOKEN``, ``AWS_SECRET_ACCESS_KEY``, ``--ssl-keyfile-password``), or is one
of ``SECRET_NAMES``. Inside a name, key and token describe data and are kept
(``output_token_logprobs``, ``token_ids_logprob``). Secret values print as
``<redacted>``; a secret that was not set (None, False, empty) stays as it was, so the fact that
a key *was* set survives and the fact that it was not does too. Independently of names, the
password (and a token-like user) of any URL with credentials (``scheme://user:pass@host``) is
replaced, in any string.

Whole words only, on purpose: ``--max-total-tokens``, ``--tokenizer-path`` and
``--kv-cache-dtype`` stay readable. When in doubt it hides more, never less: a whole value under a
secret name (a list, a nested mapping) is hidden, and an object that is not plain JSON is turned
into its redacted ``str``.

Apply ``redact`` where a record is built (``LaunchPlan.to_json_dict``, ``Manifest.to_dict``),
never at each printer.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import fields, is_dataclass

REDACTED = "<redacted>"
SECRET_WORDS = frozenset({"secret", "secrets", "password", "passwords", "passwd", "credential", "credentials"})
# key / token name a secret when they end the name (api_key, HF_TOKEN, AWS_SESSION_TOKEN); inside a
# name they describe data (output_token_logprobs, token_ids_logprob, key_positions)
SECRET_LAST_WORDS = frozenset({"key", "keys", "apikey", "token"})
SECRET_NAMES = frozenset({"api_key", "admin_api_key"})  # SGLang's own (also caught by the words)

_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")
_URL_CRED = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*://)(?P<user>[^\s/:@]*)(?::(?P<pw>[^\s/]*))?@")
_QUOTED = r"\"[^\"]*\"|'[^']*'"
# --flag=value or --flag value (a shell command line)
_FLAG_SHELL = re.compile(rf"(?<![\w-])(?P<flag>--?[A-Za-z][\w.\-]*)(?P<sep>=|\s+)(?P<value>{_QUOTED}|\S+)")
# '--flag', 'value' (a list's repr or JSON)
_FLAG_LIST = re.compile(rf"(?<![\w-])(?P<flag>--?[A-Za-z][\w.\-]*)(?P<sep>[\"']\s*,\s*)(?P<value>{_QUOTED}|[^\s,\]\)}}]+)")
# NAME=value, name='value' (a repr), "name": "value" (JSON, a dict's repr)
_ASSIGN = re.compile(rf"(?<![\w.\-])(?P<q>[\"']?)(?P<name>[A-Za-z_][\w.\-]*)(?P=q)(?P<sep>\s*[=:]\s*)(?P<value>{_QUOTED}|\S+)")
_UNSET_TEXT = frozenset({"", "None", "null", "False", "false", "''", '""'})


def words(name: str) -> list[str]:
    name = _CAMEL.sub("_", str(name).lstrip("-"))
    return [w for w in re.split(r"[-_.\s]+", name.lower()) if w]


def is_secret_name(name) -> bool:
    if not isinstance(name, str):
        return False
    canon = name.lstrip("-").replace("-", "_").lower()
    ws = words(name)
    return canon in SECRET_NAMES or any(w in SECRET_WORDS for w in ws) or bool(ws and ws[-1] in SECRET_LAST_WORDS)


def _unset(value) -> bool:
    return value is None or value is False or value == "" or value == [] or value == () or value == {}


def redact_value(value):
    """The printed form of a secret's value: kept if unset, else ``<redacted>``."""
    return value if _unset(value) else REDACTED


def _is_secret_flag(arg) -> bool:
    return isinstance(arg, str) and arg.startswith("-") and "=" not in arg and is_secret_name(arg)


def redact_text(text: str) -> str:
    """A free-form string (a command line, a URL, a log line, a repr): URL passwords,
    ``--secret-flag value``, ``--secret-flag=value``, ``'--secret-flag', 'value'``,
    ``SECRET_NAME=value`` and ``"secret_name": "value"`` replaced."""
    if not isinstance(text, str) or not text:
        return text

    def _url(m):
        user = m.group("user")
        if m.group("pw") is None:  # scheme://token@host: the user part is the credential
            return f"{m.group('scheme')}{REDACTED}@" if user else m.group(0)
        return f"{m.group('scheme')}{user}:{REDACTED}@"

    def _flag(m):
        value = m.group("value")
        if not is_secret_name(m.group("flag")) or value == REDACTED or (m.group("sep") != "=" and value.startswith("-")):
            return m.group(0)  # not secret, already hidden, or the next token is another flag
        return f"{m.group('flag')}{m.group('sep')}{REDACTED}"

    def _assign(m):
        value = m.group("value")
        bare = value.rstrip(",;)]}").strip("'\"")
        if not is_secret_name(m.group("name")) or bare in _UNSET_TEXT or bare == REDACTED:
            return m.group(0)
        return f"{m.group('q')}{m.group('name')}{m.group('q')}{m.group('sep')}{REDACTED}"

    out = _URL_CRED.sub(_url, text)
    out = _FLAG_LIST.sub(_flag, _FLAG_SHELL.sub(_flag, out))
    return _ASSIGN.sub(_assign, out)


def redact_argv(argv) -> list:
    """A command line as a list: the value after a secret flag (or after ``=``) is replaced."""
    return _redact_seq([str(a) for a in argv])


def _redact_seq(seq) -> list:
    """Items of a list: the item after a secret flag hidden, every other item redacted on its own."""
    out, hide_next = [], False
    for a in seq:
        if hide_next and not (isinstance(a, str) and a.startswith("--")):
            out.append(redact_value(a))
            hide_next = False
            continue
        hide_next = _is_secret_flag(a)
        if isinstance(a, str) and a.startswith("-") and "=" in a:
            flag, value = a.split("=", 1)
            out.append(f"{flag}={REDACTED}" if is_secret_name(flag) and value else redact_text(a))
        else:
            out.append(redact(a))
    return out


def redact(obj):
    """A deep copy of ``obj`` with every secret replaced: mapping values under a secret name
    (whole), the item after a secret flag in any list, secrets inside strings. Dataclasses become
    dicts; objects that are not plain JSON become their redacted ``str``."""
    if obj is None or isinstance(obj, (bool, int, float)):
        return obj
    if isinstance(obj, str):
        return redact_text(obj)
    if isinstance(obj, Mapping):
        return {k: redact_value(v) if is_secret_name(k) else redact(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        out = _redact_seq(obj)
        return tuple(out) if isinstance(obj, tuple) else out
    if is_dataclass(obj) and not isinstance(obj, type):
        return redact({f.name: getattr(obj, f.name, None) for f in fields(obj)})
    return redact_text(str(obj))


def redact_server_args(server_args) -> dict:
    """Every field of a resolved SGLang ``ServerArgs`` (a dataclass, or any object), redacted."""
    if is_dataclass(server_args):
        return redact(server_args)
    return redact(dict(vars(server_args)))
