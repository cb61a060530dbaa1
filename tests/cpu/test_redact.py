"""The one redaction rule (``true_on_policy.redact``): what is a secret name, every form a
secret value takes (argv, mappings, free text, URLs), and what stays readable."""

import json

import pytest

from true_on_policy.redact import REDACTED, is_secret_name, redact, redact_argv, redact_server_args, redact_text

SECRET = "S3CR3T-value_42"


@pytest.mark.parametrize("name", [
    "api_key", "admin_api_key", "--api-key", "--admin-api-key", "HF_TOKEN", "AWS_SECRET_ACCESS_KEY",
    "--ssl-keyfile-password", "apiKey", "adminApiKey", "APIKey", "accessToken", "dbPassword", "credentials",
    "GOOGLE_APPLICATION_CREDENTIALS", "my.secret", "WANDB_API_KEY", "passwd",
])
def test_secret_names(name):
    assert is_secret_name(name)


@pytest.mark.parametrize("name", [
    "--max-total-tokens", "--tokenizer-path", "--kv-cache-dtype", "max_prefill_tokens", "tokenizer_mode",
    "--ssl-keyfile", "monkey", "keyboard", "NCCL_ALGO", "SGLANG_TRUE_ON_POLICY_MANIFEST_DIR", "model_path", None, 3,
])
def test_not_secret_names(name):
    assert not is_secret_name(name)


def test_argv_both_forms_and_readable_neighbours():
    argv = ["--model-path", "/m", "--api-key", SECRET, "--admin-api-key=" + SECRET, "--max-total-tokens", "64",
            "--tokenizer-path", "/tok", "--kv-cache-dtype", "auto", "--ssl-keyfile-password", SECRET]
    got = redact_argv(argv)
    assert SECRET not in json.dumps(got)
    assert got == ["--model-path", "/m", "--api-key", REDACTED, f"--admin-api-key={REDACTED}", "--max-total-tokens",
                   "64", "--tokenizer-path", "/tok", "--kv-cache-dtype", "auto", "--ssl-keyfile-password", REDACTED]


def test_argv_secret_flag_followed_by_a_flag_hides_nothing_else():
    assert redact_argv(["--api-key", "--port", "1"]) == ["--api-key", "--port", "1"]
    assert redact_argv(["--port", "1", "--api-key"]) == ["--port", "1", "--api-key"]
    assert redact_argv(["--api-key="]) == ["--api-key="]  # set to empty: unset stays visible


@pytest.mark.parametrize("text", [
    f"--api-key {SECRET} --port 1", f"--api-key={SECRET}", f"HF_TOKEN={SECRET} python x.py",
    f"['--api-key', '{SECRET}', '--port', '1']", f'["--admin-api-key", "{SECRET}"]',
    f"ServerArgs(port=1, api_key='{SECRET}', admin_api_key=None)", f'{{"admin_api_key": "{SECRET}", "port": 1}}',
    f"https://user:{SECRET}@example.org/x", f"https://{SECRET}@example.org/repo.git",
    f"redis://:{SECRET}@h:6379/0", f"--api-key '{SECRET} with space'", f"--api-key=-{SECRET}",
])
def test_text_forms(text):
    out = redact_text(text)
    assert SECRET not in out and REDACTED in out, out
    assert redact_text(out) == out  # idempotent


def test_text_keeps_what_is_not_secret():
    for text in ("--max-total-tokens 64 --tokenizer-path /t --kv-cache-dtype fp8_e5m2", "http://127.0.0.1:30000/health",
                 "patch rope: a.b.forward -> true_on_policy.c", "multi-key cache", "git@github.com:o/r.git",
                 "ServerArgs(api_key=None, admin_api_key=None)", "NCCL_ALGO=Tree"):
        assert redact_text(text) == text
    assert redact_text("https://user:pw@h/x") == f"https://user:{REDACTED}@h/x"  # the user name stays


def test_mapping_nested_and_unset():
    doc = {"env_set": {"HF_TOKEN": SECRET, "NCCL_ALGO": "Tree", "EMPTY_TOKEN": "", "NO_KEY": None},
           "extra": {"argv": ["--port", "1", "--api-key", SECRET], "nested": [{"password": SECRET, "n": 2}],
                     "credentials": {"user": "u", "pw": SECRET}, "api_keys": [SECRET], "url": f"s3://a:{SECRET}@b"},
           "api_key": None, "admin_api_key": False, "tup": ("--admin-api-key", SECRET)}
    got = redact(doc)
    assert SECRET not in json.dumps(got)
    assert got["env_set"] == {"HF_TOKEN": REDACTED, "NCCL_ALGO": "Tree", "EMPTY_TOKEN": "", "NO_KEY": None}
    assert got["extra"]["argv"] == ["--port", "1", "--api-key", REDACTED]
    assert got["extra"]["nested"] == [{"password": REDACTED, "n": 2}]
    assert got["extra"]["credentials"] == REDACTED and got["extra"]["api_keys"] == REDACTED
    assert got["api_key"] is None and got["admin_api_key"] is False and got["tup"] == ("--admin-api-key", REDACTED)
    assert doc["env_set"]["HF_TOKEN"] == SECRET  # a copy: the input is untouched


def test_list_with_non_strings_and_objects():
    class Holder:
        def __str__(self):
            return f"Holder(api_key='{SECRET}')"

    got = redact([1, "--api-key", SECRET, Holder()])
    assert got[:3] == [1, "--api-key", REDACTED] and SECRET not in got[3] and REDACTED in got[3]


def test_server_args(tiny_cache):
    from sglang.srt.server_args import ServerArgs

    from true_on_policy import tiny_model

    path = tiny_model.ensure("embedded")
    sa = ServerArgs(model_path=path, device="cpu", api_key=SECRET, admin_api_key=SECRET + "2", max_total_tokens=64,
                    tokenizer_path=path)
    got = redact_server_args(sa)
    assert SECRET not in json.dumps(got, default=str)
    assert got["api_key"] == REDACTED and got["admin_api_key"] == REDACTED and got["ssl_keyfile_password"] is None
    assert got["max_total_tokens"] == 64 and got["tokenizer_path"] == path and got["model_path"] == path


def test_key_and_token_inside_a_name_describe_data():
    from true_on_policy.redact import is_secret_name, redact

    for data in ("output_token_logprobs", "token_ids_logprob", "distinct_token_sequences", "max_total_tokens",
                 "key_positions", "--tokenizer-path"):
        assert not is_secret_name(data), data
    for secret in ("HF_TOKEN", "AWS_SESSION_TOKEN", "api_key", "WANDB_API_KEY", "db_password_file", "apiKey"):
        assert is_secret_name(secret), secret
    assert redact({"output_token_logprobs": [[-0.5, 3]], "hf_token": "x"}) == {
        "output_token_logprobs": [[-0.5, 3]], "hf_token": "<redacted>"}
