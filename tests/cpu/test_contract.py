"""Contract: frozen data, canonical JSON round trip, stable fingerprint, loud registry."""

import dataclasses
import json

import pytest
from helpers import run_py

from true_on_policy.contract import ArgRule, Contract, UnknownContractError, get_contract, known_contracts

NAME = "qwen3_moe_true_on_policy_v1"
# v1 is frozen: a change to its content must be deliberate (new golden + CHANGELOG ### Contract).
GOLDEN_FINGERPRINT = "78aa0767a9892e3cd8f89c0dd6b9899d97c3a94340c143e8547dc9c26d66f734"
PREVIEW = "qwen3_moe_true_on_policy_tp_preview_v1"
# The preview changes with its layouts (PP 1-8 since issue 15): pinned too, each change in CHANGELOG ### Contract.
PREVIEW_FINGERPRINT = "d8d6920d8d08f918d0ecb83989612c6f99025e19281447b03f4f1207f4f1542a"


def test_round_trip_is_identity():
    c = get_contract(NAME)
    back = Contract.from_json(c.canonical_json())
    assert back == c
    assert back.canonical_json() == c.canonical_json()
    assert back.fingerprint == c.fingerprint


def test_fingerprint_is_pinned_and_stable_across_processes():
    c = get_contract(NAME)
    assert c.fingerprint == GOLDEN_FINGERPRINT
    for seed in ("0", "12345"):
        r = run_py(f"from true_on_policy.contract import get_contract; print(get_contract('{NAME}').fingerprint)",
                   {"PYTHONHASHSEED": seed})
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == GOLDEN_FINGERPRINT


def test_canonical_json_is_sorted_and_compact():
    text = get_contract(NAME).canonical_json()
    assert text == json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"))


def test_any_change_changes_the_fingerprint():
    c = get_contract(NAME)
    changed = dataclasses.replace(c, logprob=c.logprob + " ")
    assert changed.fingerprint != c.fingerprint


def test_contract_is_frozen():
    c = get_contract(NAME)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.name = "x"  # type: ignore[misc]


def test_unknown_name_lists_known_ones():
    with pytest.raises(UnknownContractError) as e:
        get_contract("qwen3_moe_true_on_policy_v0")
    assert NAME in str(e.value) and "known contracts" in str(e.value)
    assert NAME in known_contracts()


def test_validation_in_post_init():
    c = get_contract(NAME)
    with pytest.raises(ValueError, match="_v1"):
        dataclasses.replace(c, name="qwen3_moe_true_on_policy")
    with pytest.raises(ValueError, match="duplicate"):
        dataclasses.replace(c, args=c.args + (c.args[0],))
    with pytest.raises(ValueError, match="not in allowed"):
        ArgRule("x", "--x", (1,), "why", "alt", force=2, forced=True)


def test_contract_states_what_the_issue_requires():
    c = get_contract(NAME)
    assert c.architectures == ("Qwen3MoeForCausalLM",)
    assert dict(c.versions) == {"sglang": "0.5.17", "torch": "2.11.0"}
    assert c.layouts.rollout_tp == (1,)  # TP/EP > 1: the preview contract until parity is measured there
    assert c.arg("enable_dp_attention").allowed == (False,)
    assert c.required_env()["NCCL_NVLS_ENABLE"] == "0"
    ops = {n.op for n in c.numerics}
    assert {"rmsnorm", "column_linear", "row_linear_tp_reduce", "attention", "rope", "moe_router",
            "moe_combine", "token_logprob"} <= ops
    assert all(n.rounding for n in c.numerics)


def test_cli_show_prints_contract_and_fingerprint():
    r = run_py(f"import sys; from true_on_policy.__main__ import main; sys.exit(main(['contract','show','{NAME}']))")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["fingerprint"] == GOLDEN_FINGERPRINT
    assert Contract.from_dict(doc["contract"]).fingerprint == GOLDEN_FINGERPRINT
    bad = run_py("import sys; from true_on_policy.__main__ import main; sys.exit(main(['contract','show','nope']))")
    assert bad.returncode == 2 and NAME in bad.stderr


def test_tp_preview_contract_widens_only_tp_ep_and_pp():
    v1 = get_contract("qwen3_moe_true_on_policy_v1")
    pv = get_contract(PREVIEW)
    assert pv.fingerprint == PREVIEW_FINGERPRINT != v1.fingerprint
    assert pv.arg("tp_size").allowed == pv.arg("ep_size").allowed == (1, 2, 4, 8)
    assert pv.arg("pp_size").allowed == pv.layouts.rollout_pp == (1, 2, 3, 4, 5, 6, 7, 8)
    assert v1.arg("pp_size").allowed == v1.layouts.rollout_pp == (1,)
    assert pv.layouts.rollout_tp == pv.layouts.rollout_ep == (1, 2, 4, 8)
    assert any("disable_overlap_schedule" in r for r in pv.layouts.rollout_rules)
    same = [r.dest for r in v1.args if r.dest not in ("tp_size", "ep_size", "pp_size")]
    assert all(pv.arg(d) == v1.arg(d) for d in same) and pv.env == v1.env and pv.numerics == v1.numerics
    assert "tp_preview" in v1.arg("tp_size").alternative


FLAT = "qwen3_moe_true_on_policy_flat_v1"
# pinned: the flat contract's evidence names this fingerprint (a contract change must change it here too)
FLAT_FINGERPRINT = "bf0f9c647a8e0e370ae4089ed2a494a8fc564ef17a2d799bb8410c17337b810a"


def test_flat_contract_is_v1_at_tree_width_1():
    """The flat contract changes only the tree width (and the two ops it names) and the trainer
    layouts that width forbids; v1 and the preview keep their pinned fingerprints, since a width
    of 8 is not serialised."""
    v1, flat = get_contract(NAME), get_contract(FLAT)
    assert flat.tree_width == 1 and v1.tree_width == get_contract(PREVIEW).tree_width == 8
    assert "tree_width" not in v1.to_dict() and flat.to_dict()["tree_width"] == 1
    assert Contract.from_json(flat.canonical_json()) == flat and flat.fingerprint == FLAT_FINGERPRINT
    changed = {a.op for a, b in zip(v1.numerics, flat.numerics, strict=True) if a != b}
    assert changed == {"row_linear_tp_reduce", "moe_experts"}
    assert all("tree width" in n.reduction_order + " ".join(n.rounding) for n in flat.numerics if n.op in changed)
    assert flat.args == v1.args and flat.env == v1.env and flat.layouts.rollout_tp == (1,)
    assert dict(flat.layouts.trainer)["tp"].startswith("1") and dict(flat.layouts.trainer)["expert_tp"].startswith("1")


W2 = "qwen3_moe_true_on_policy_w2_preview_v1"


def test_w2_preview_is_v1_at_tree_width_2():
    """The width-2 preview changes only the tree width, the two ops it names and the trainer degrees
    that width allows (TP and expert-TP 1 or 2); v1 and the flat contract keep their fingerprints."""
    from true_on_policy.contract import contract_status

    v1, w2 = get_contract(NAME), get_contract(W2)
    assert w2.tree_width == 2 and w2.to_dict()["tree_width"] == 2 and contract_status(W2) == "preview"
    assert Contract.from_json(w2.canonical_json()) == w2 and w2.fingerprint not in (v1.fingerprint, FLAT_FINGERPRINT)
    changed = {a.op for a, b in zip(v1.numerics, w2.numerics, strict=True) if a != b}
    assert changed == {"row_linear_tp_reduce", "moe_experts"}
    assert all("tree width 2" in n.reduction_order + " ".join(n.rounding) for n in w2.numerics if n.op in changed)
    assert w2.args == v1.args and w2.env == v1.env and w2.layouts.rollout_tp == v1.layouts.rollout_tp == (1,)
    trainer = dict(w2.layouts.trainer)
    assert trainer["tp"].startswith("1 or 2") and trainer["expert_tp"].startswith("1 or 2")
    assert get_contract(FLAT).fingerprint == FLAT_FINGERPRINT and "preview" in w2.notes[-1].lower()


@pytest.mark.parametrize("width, tp, why", [(3, (1,), "tree_width must be 1, 2, 4 or 8"),
                                            (2, (1, 2, 4), "do not divide tree_width 2")])
def test_tree_width_is_validated(width, tp, why):
    v1 = get_contract(NAME)
    with pytest.raises(ValueError, match=why):
        dataclasses.replace(v1, tree_width=width, layouts=dataclasses.replace(v1.layouts, rollout_tp=tp))


PG, FLAT_PG = "qwen3_moe_true_on_policy_pg_preview_v1", "qwen3_moe_true_on_policy_flat_pg_preview_v1"


@pytest.mark.parametrize("name, base", [(PG, NAME), (FLAT_PG, FLAT)])
def test_prefill_graph_previews_differ_from_their_base_only_in_the_prefill_graph_rule(name, base):
    """Each preview is its base (numerics, environment, layouts, tree width) with SGLang's breakable
    prefill graphs forced on instead of off; the bases keep their pinned fingerprints."""
    pg, b = get_contract(name), get_contract(base)
    assert pg.numerics == b.numerics and pg.env == b.env and pg.layouts == b.layouts and pg.tree_width == b.tree_width
    diff = [x.dest for x, y in zip(b.args, pg.args, strict=True) if x != y]
    assert diff == ["cuda_graph_backend_prefill"] and b.arg("cuda_graph_backend_prefill").force == "disabled"
    rule = pg.arg("cuda_graph_backend_prefill")
    assert rule.allowed == (None, "breakable") and not rule.forced and rule.force is None
    from true_on_policy.contract.policy import graph_backends

    assert graph_backends(pg) == {"decode": ("full", "disabled"), "prefill": ("breakable", "disabled")}
    assert graph_backends(b) == {"decode": ("full", "disabled"), "prefill": ("disabled",)}
    assert pg.fingerprint != b.fingerprint and Contract.from_json(pg.canonical_json()) == pg
    assert get_contract(FLAT).fingerprint == FLAT_FINGERPRINT and "preview" in pg.notes[-1].lower()


def test_the_registry_has_a_status_column_outside_the_fingerprint():
    from true_on_policy.contract import contract_status, known_contracts
    from true_on_policy.contract.schema import STATUSES

    status = {n: contract_status(n) for n in known_contracts()}
    assert set(status.values()) <= set(STATUSES)
    assert status["qwen3_moe_true_on_policy_flat_v1"] == "verified" == status["qwen3_moe_true_on_policy_v1"]
    assert all(status[n] == "preview" for n in status if "preview" in n)
    r = run_py("import sys; from true_on_policy.__main__ import main; sys.exit(main(['contract','list']))")
    assert r.returncode == 0
    rows = [line.split() for line in r.stdout.strip().splitlines()]
    assert {row[0]: row[1] for row in rows} == status
    assert all(get_contract(row[0]).fingerprint.startswith(row[2]) for row in rows)
