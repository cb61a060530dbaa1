"""GPU time of one call, as every benchmark here takes it."""

from __future__ import annotations


def cuda_ms(fn) -> float:
    """Milliseconds between two CUDA events recorded around ``fn()`` on the current stream (the
    host waits for the second one)."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)
