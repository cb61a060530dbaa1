"""Per-sample seeds (CPU, on SGLang's real SamplingParams / TokenizedGenerateReqInput): an n > 1
group gets distinct seeds reproducible from its base; unseeded requests get distinct seeds from
the server RNG (reproducible from --random-seed); explicit seeds are kept; the seed used is
reported; the shared SamplingParams of SGLang's n > 1 copies is never mutated."""

import copy

from sglang.srt.sampling.sampling_params import SamplingParams
from true_on_policy.patches.seeds import SeedAssigner, derive_seed


class _Tok:
    def __init__(self, rid, **sp):
        self.rid = rid
        self.sampling_params = SamplingParams(**sp)


def _group(a, logical, n, seed=None, shared=None):
    """SGLang 0.5.17's n > 1 path: one prefix pass (max_new_tokens 0), then n shallow copies."""
    base = shared or _Tok(logical, n=n, sampling_seed=seed)
    warm = copy.copy(base)
    warm.sampling_params = copy.copy(base.sampling_params)
    warm.sampling_params.max_new_tokens = 0
    warm.rid = f"{logical}_warm"
    a.assign(warm, logical)
    out = []
    for j in range(n):
        t = copy.copy(base)
        t.rid = f"{logical}_{j}"
        a.assign(t, logical)
        out.append(t.sampling_params.sampling_seed)
    assert base.sampling_params.sampling_seed == seed  # the shared object is untouched
    return out


def test_group_seeds_distinct_and_reproducible_from_the_base():
    a = SeedAssigner(random_seed=0)
    s = _group(a, "r1", 4, seed=7)
    assert s == [derive_seed(7, j) for j in range(4)] and len(set(s)) == 4
    assert _group(SeedAssigner(random_seed=123), "r2", 4, seed=7) == s  # a resent base replays the group
    assert a.reported("r1_2") == s[2]
    a.done("r1_2")
    assert a.reported("r1_2") is None
    assert not a.groups  # the group's state is gone after its n samples


def test_unseeded_requests_get_distinct_seeds_from_the_server_rng():
    a = SeedAssigner(random_seed=5)
    toks = [_Tok(f"c{i}", temperature=1.0) for i in range(8)]
    for t in toks:
        a.assign(t, None)
    seeds = [t.sampling_params.sampling_seed for t in toks]
    assert len(set(seeds)) == 8 and all(0 <= x < 2**63 for x in seeds)
    b = SeedAssigner(random_seed=5)
    again = [_Tok(f"c{i}") for i in range(8)]
    for t in again:
        b.assign(t, None)
    assert [t.sampling_params.sampling_seed for t in again] == seeds  # --random-seed reproduces the server
    c = SeedAssigner(random_seed=6)
    other = _Tok("x")
    c.assign(other, None)
    assert other.sampling_params.sampling_seed != seeds[0]
    unseeded_group = _group(SeedAssigner(random_seed=5), "g", 3)
    assert len(set(unseeded_group)) == 3


def test_explicit_seed_kept_for_a_single_request():
    a = SeedAssigner(random_seed=0)
    t = _Tok("one", sampling_seed=99)
    a.assign(t, None)
    assert t.sampling_params.sampling_seed == 99 and a.reported("one") == 99


def test_resolved_parameters_are_reported():
    a = SeedAssigner(random_seed=0)
    t = _Tok("g", temperature=0.0, top_p=0.8)
    a.assign(t, None)
    assert a.meta("g")["sampling_params_used"] == {"temperature": 1.0, "top_k": 1, "top_p": 0.8, "min_p": 0.0}
    u = _Tok("u")
    a.assign(u, None)
    assert a.meta("u")["sampling_params_used"]["top_k"] == -1
