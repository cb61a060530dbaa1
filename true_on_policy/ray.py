"""``true_on_policy.ray``, the path the Ray issue names and users guess: a re-export of
``true_on_policy.rollout.ray`` (needs Ray; without it, the same clear ImportError)."""

from true_on_policy.rollout.ray import *  # noqa: F401,F403
from true_on_policy.rollout.ray import __all__  # noqa: F401
