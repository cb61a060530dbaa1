"""The rollout workloads the throughput benchmark times: what each request asks for.

- ``plain``: ``--prompts`` prompts of ``--min-prompt``..``--max-prompt`` tokens, ``--new-tokens``
  new tokens each, T = 1.0, no truncation;
- ``qwen``: the same requests with Qwen3's sampling sent in each: top_k 20, top_p 0.95;
- ``tail``: the same prompts with RL-like lengths: 15 % of the requests (rounded) draw 1024..2048
  new tokens, the rest 32..256 (uniform integers, seeded), so the batch shrinks to a long tail;
- ``long``: 64 prompts of 1024..2048 tokens, 4096 new tokens each.

Every request sets ``ignore_eos``, so a request generates exactly the tokens drawn for it. Every
draw is a function of its arguments and fixed seeds: every pass, every variant and every run of a
workload send the same prompts and lengths (only the per-request sampling seeds move per pass).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

PROMPT_SEED = 21  # make_prompts' seed for plain / qwen / tail (the prompts of the runs before workloads)
LONG_PROMPT_SEED = 22
TAIL_SEED = 37
TAIL_SHORT, TAIL_LONG, TAIL_LONG_SHARE = (32, 256), (1024, 2048), 0.15
LONG_PROMPTS, LONG_PROMPT_LENGTHS, LONG_NEW_TOKENS = 64, (1024, 2048), 4096
QWEN_SAMPLING = {"top_k": 20, "top_p": 0.95}
WARM_CAP = 256  # a warm-up sends the workload's requests with at most this many new tokens each


@dataclass(frozen=True)
class Workload:
    name: str
    passes: int  # timed passes per variant (the median is taken over them)
    sampling: dict = field(default_factory=dict)  # sent in every request besides T, length, seed


WORKLOADS = {w.name: w for w in (Workload("plain", 3), Workload("qwen", 3, dict(QWEN_SAMPLING)),
                                 Workload("tail", 2), Workload("long", 2))}


def get(name: str) -> Workload:
    try:
        return WORKLOADS[name]
    except KeyError:
        raise KeyError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}") from None


def tail_lengths(n: int, seed: int = TAIL_SEED) -> list[int]:
    """New tokens of each of ``n`` requests: round(15 % of n) long ones (1024..2048) at seeded
    positions, the others short (32..256)."""
    rng = random.Random(seed)
    n_long = round(TAIL_LONG_SHARE * n)
    is_long = [True] * n_long + [False] * (n - n_long)
    rng.shuffle(is_long)
    return [rng.randint(*(TAIL_LONG if x else TAIL_SHORT)) for x in is_long]


@dataclass(frozen=True)
class Draw:
    """One workload's requests: prompts (token ids), new tokens of each, extra sampling."""

    workload: str
    prompts: list
    new_tokens: list
    sampling: dict

    def params(self, seed0: int, cap: int | None = None) -> list[dict]:
        """Sampling parameters of every request (seed ``seed0 + i``); ``cap`` bounds new tokens."""
        return [{"temperature": 1.0, "max_new_tokens": n if cap is None else min(n, cap), "ignore_eos": True,
                 "sampling_seed": seed0 + i, **self.sampling} for i, n in enumerate(self.new_tokens)]

    def expected_tokens(self, cap: int | None = None) -> int:
        return sum(n if cap is None else min(n, cap) for n in self.new_tokens)

    def record(self) -> dict:
        """What the evidence says of the draw (the per-request lengths where they vary)."""
        lens = [len(p) for p in self.prompts]
        out = {"requests": len(self.prompts), "prompt_tokens": sum(lens), "prompt_lengths": [min(lens), max(lens)],
               "new_tokens_total": sum(self.new_tokens), "new_tokens_range": [min(self.new_tokens), max(self.new_tokens)],
               "sampling": {"temperature": 1.0, **self.sampling}, "ignore_eos": True}
        if len(set(self.new_tokens)) > 1:
            out["new_tokens"] = list(self.new_tokens)
        return out


def draw(name: str, vocab: int, prompts: int, min_prompt: int, max_prompt: int, new_tokens: int) -> Draw:
    """The requests of workload ``name`` (``prompts``, the prompt lengths and ``new_tokens`` are
    the benchmark's arguments; ``long`` has its own fixed sizes)."""
    from true_on_policy.harness.parity import make_prompts

    w = get(name)
    if name == "long":
        ids = make_prompts(LONG_PROMPTS, vocab, LONG_PROMPT_SEED, *LONG_PROMPT_LENGTHS)
        return Draw(name, ids, [LONG_NEW_TOKENS] * LONG_PROMPTS, dict(w.sampling))
    ids = make_prompts(prompts, vocab, PROMPT_SEED, min_prompt, max_prompt)
    lens = tail_lengths(prompts) if name == "tail" else [new_tokens] * prompts
    return Draw(name, ids, lens, dict(w.sampling))
