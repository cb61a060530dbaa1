"""``python -m launch.server``: SGLang's HTTP server, with ``--true-on-policy`` to enforce a contract."""
