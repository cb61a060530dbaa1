"""GPU tier: the per-sample seeds and the per-request contract through ``TrueOnPolicyEngine``
(``sglang.Engine`` in-process: the same tokenizer seam as HTTP, another entry point).

- ``n = 4`` in one call gives 4 distinct samples with reported seeds, the same 4 again;
- 4 unseeded copies of one prompt in one batch give 4 distinct samples, each replayable;
- an off-contract request raises ``ValueError`` naming the parameter, and the engine keeps serving.
"""

import pytest

pytestmark = pytest.mark.gpu

PROMPT = [5, 17, 99, 3, 42, 7]


def _toks(o):
    return [t[1] for t in o["meta_info"]["output_token_logprobs"]]


def test_engine_groups_seeds_and_refusals(tiny_cache, gpu_evidence):
    from true_on_policy.rollout.engine import TrueOnPolicyEngine

    sp = {"temperature": 1.0, "max_new_tokens": 12, "ignore_eos": True}
    with TrueOnPolicyEngine(mem_fraction_static=0.3, random_seed=7) as eng:
        group = eng.generate(input_ids=PROMPT, sampling_params={**sp, "n": 4, "sampling_seed": 3})
        again = eng.generate(input_ids=PROMPT, sampling_params={**sp, "n": 4, "sampling_seed": 3})
        assert len({tuple(_toks(o)) for o in group}) == 4
        assert sorted(map(_toks, group)) == sorted(map(_toks, again))
        copies = eng.generate(input_ids=[PROMPT] * 4, sampling_params=[dict(sp) for _ in range(4)])
        assert len({tuple(_toks(o)) for o in copies}) == 4
        for o in copies:
            seed = o["meta_info"]["sampling_seed"]
            replay = eng.generate(input_ids=PROMPT, sampling_params={**sp, "sampling_seed": seed})
            assert _toks(replay) == _toks(o)
            assert replay["meta_info"]["output_token_logprobs"] == o["meta_info"]["output_token_logprobs"]
        with pytest.raises(ValueError, match="presence_penalty"):
            eng.generate(input_ids=PROMPT, sampling_params={**sp, "presence_penalty": 0.5})
        after = eng.generate(input_ids=PROMPT, sampling_params={**sp, "sampling_seed": 1})
        assert len(_toks(after)) == 12
    gpu_evidence.append({"test": "engine_groups_seeds_and_refusals", "group_distinct": 4, "copies_distinct": 4})
