"""Old path of ``python -m true_on_policy.harness.parity``, kept only because the commands recorded
in evidence/ run it; a re-export of ``main``. Code imports ``true_on_policy.harness.parity``."""

from true_on_policy.harness.parity import main

if __name__ == "__main__":
    raise SystemExit(main())
