"""The error a kernel raises when its arguments lie outside what it computes: a kernel limit.

``KernelLimitError`` is a ``ValueError``, so every caller that caught the kernels' argument checks
before still does. While SGLang runs a batch, ``patches/scheduler_guard.py`` turns one that escapes
the forward into a failed batch (its requests aborted with the message) instead of a dead server.
The launch-time model check (``true_on_policy/contract/model_check.py``) refuses every limit it
knows of before any GPU work, so reaching one here means a layout that check did not foresee.
"""

from __future__ import annotations


class KernelLimitError(ValueError):
    """A kernel's argument check failed: a shape, dtype, layout or value outside its limits."""
