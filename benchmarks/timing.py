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


def captured(fn):
    """(CUDA graph, its static output) of ``fn``, after one eager call on a side stream (compiles,
    allocates)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def replay_ms(graph, reps: int) -> float:
    """Milliseconds per replay of ``graph`` over ``reps`` back-to-back replays."""

    def replays():
        for _ in range(reps):
            graph.replay()
    return cuda_ms(replays) / reps


def reps_for(graph, target_ms: float = 5.0) -> int:
    """Replays (3 to 200) that take about ``target_ms``, from two timed ones."""
    return max(3, min(200, int(target_ms / max(replay_ms(graph, 2), 1e-3))))
