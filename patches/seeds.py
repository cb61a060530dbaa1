"""Per-sample seeds seam (sglang/srt/managers/tokenizer_manager.py, the tokenizer side: main process).

Stock deterministic mode gives every request without ``sampling_seed`` the seed 42, and SGLang
0.5.17 sends the ``n`` samples of a parallel-sampling request as shallow copies of one tokenized
request, so a GRPO group -- ``n = 4`` in one request, or 4 copies of one prompt -- comes back
identical. Under the overlay every request leaving the tokenizer for a scheduler gets its own
seed here, at the one place all entries meet (``_send_one_request`` / ``_send_batch_request``:
``/generate``, the OpenAI routes, ``Engine.generate``):

- a request with ``sampling_seed = s`` and n == 1 keeps s;
- a request without one gets a fresh seed from a server RNG seeded by ``--random-seed``;
- sample j (0-based, in the order SGLang sends them) of an n > 1 request gets
  ``derive_seed(base, j)``, base = its ``sampling_seed`` or a fresh server seed.

Every response reports the seed its tokens were drawn with in ``meta_info["sampling_seed"]`` and
the resolved temperature / top_k / top_p / min_p in ``meta_info["sampling_params_used"]``;
resending that seed with n = 1 replays the sample exactly, and resending the base with the same n
replays the group. Several tokenizer workers would each need this state: the contract refuses
``--tokenizer-worker-num > 1``.
"""

from __future__ import annotations

import copy
import hashlib
import random
import threading

from true_on_policy.manifest import PatchRecord
from true_on_policy.patching import wrap

TM = "sglang.srt.managers.tokenizer_manager.TokenizerManager"
SEND_ONE = f"{TM}._send_one_request"
SEND_BATCH = f"{TM}._send_batch_request"
WAIT_ONE = f"{TM}._wait_one_response"
SEED_BITS = 63  # SGLang keeps seeds in int64 tensors


def derive_seed(base: int, sample_index: int) -> int:
    """A 63-bit seed from (base, sample index): blake2b, so nearby bases do not collide."""
    digest = hashlib.blake2b(f"true_on_policy:{int(base)}:{int(sample_index)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << SEED_BITS) - 1)


def used(sp) -> dict:
    """The resolved parameters the sampler draws with (after generation_config / preferred
    defaults and SGLang's normalisation: T = 0 is T = 1 with top_k = 1): what the trainer's
    ``token_logprobs(temperature=, top_k=, top_p=, min_p=)`` needs to reproduce the log-probs."""
    from sglang.srt.sampling.sampling_params import TOP_K_ALL

    return {"temperature": sp.temperature, "top_k": -1 if sp.top_k >= TOP_K_ALL else sp.top_k,
            "top_p": sp.top_p, "min_p": sp.min_p}


class SeedAssigner:
    """Seeds for the requests one tokenizer manager sends (thread-safe; one per manager)."""

    def __init__(self, random_seed):
        self.rng = random.Random(f"true_on_policy:{random_seed}")
        self.groups: dict[str, list[int]] = {}  # logical rid -> [base, next sample index]
        self.by_rid: dict[str, dict] = {}  # rid -> what its tokens were drawn with, until its response is complete
        self.lock = threading.Lock()

    def fresh(self) -> int:
        return self.rng.getrandbits(SEED_BITS)

    def assign(self, tok, logical_rid: str | None) -> None:
        sp = getattr(tok, "sampling_params", None)
        if sp is None or not hasattr(sp, "sampling_seed"):
            return
        with self.lock:
            if logical_rid is not None and sp.max_new_tokens == 0:
                return  # the prefix-caching pass SGLang sends before an n > 1 group: draws nothing
            if logical_rid is not None:
                group = self.groups.setdefault(logical_rid, [
                    sp.sampling_seed if sp.sampling_seed is not None else self.fresh(), 0])
                seed = derive_seed(group[0], group[1])
                group[1] += 1
                if group[1] >= max(int(getattr(sp, "n", 1) or 1), 1):
                    del self.groups[logical_rid]
            else:
                seed = sp.sampling_seed if sp.sampling_seed is not None else self.fresh()
            tok.sampling_params = copy.copy(sp)  # n > 1 copies share one SamplingParams
            tok.sampling_params.sampling_seed = seed
            self.by_rid[tok.rid] = {"sampling_seed": seed, "sampling_params_used": used(tok.sampling_params)}

    def reported(self, rid) -> int | None:
        return (self.by_rid.get(rid) or {}).get("sampling_seed")

    def meta(self, rid) -> dict | None:
        return self.by_rid.get(rid)

    def done(self, rid) -> None:
        with self.lock:
            self.by_rid.pop(rid, None)


def assigner(tm) -> SeedAssigner:
    a = tm.__dict__.get("_true_on_policy_seeds")
    if a is None:
        a = tm.__dict__.setdefault("_true_on_policy_seeds", SeedAssigner(tm.server_args.random_seed))
    return a


def _enabled() -> bool:
    from true_on_policy import env

    return env.ENABLED.is_true()  # a stock engine in the same process stays stock


def _send_one(original):
    def tpo_send_one_request(self, tokenized_obj):
        if _enabled():
            assigner(self).assign(tokenized_obj, self.child_rid_to_logical_rid.get(tokenized_obj.rid))
        return original(self, tokenized_obj)

    return tpo_send_one_request


def _send_batch(original):
    def tpo_send_batch_request(self, tokenized_objs):
        if _enabled():
            for tok in tokenized_objs:
                assigner(self).assign(tok, self.child_rid_to_logical_rid.get(tok.rid))
        return original(self, tokenized_objs)

    return tpo_send_batch_request


def _wait_one(original):
    async def tpo_wait_one_response(self, obj, request=None):
        rid = obj.rid
        try:
            async for out in original(self, obj, request):
                meta = assigner(self).meta(rid) if _enabled() else None
                if meta is not None and isinstance(out, dict) and isinstance(out.get("meta_info"), dict):
                    out["meta_info"].update(meta)
                yield out
        finally:
            if _enabled():
                assigner(self).done(rid)

    return tpo_wait_one_response


def apply(policy) -> PatchRecord:
    reps = [wrap(SEND_ONE, _send_one), wrap(SEND_BATCH, _send_batch), wrap(WAIT_ONE, _wait_one)]
    return PatchRecord.of("seeds", reps,
                       ["every request gets its own seed (given, or from a server RNG seeded by --random-seed); "
                        "sample j of an n > 1 request gets derive_seed(base, j); meta_info.sampling_seed reports it"])
