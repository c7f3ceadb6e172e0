"""Unit and property tests of the shard view, dispatch planner and repair plan (pure Python)."""

from __future__ import annotations

import hashlib
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from registry.planner import DispatchPlan, PlanningError, TokenRouting, plan_dispatch
from moe.placement import (
    RepairRow,
    place,
    placement_score,
    plan_repair,
    rank_providers,
    rows_for,
)
from moe.shardmap import (
    RESIDENCIES,
    ROLES,
    HolderInfo,
    HoldingInfo,
    ProviderInfo,
    ReplicationPolicy,
    ShardView,
)

M = "qwen3-30b-a3b"


def pid(name: str | int) -> str:
    """A deterministic 64-hex provider id."""
    return hashlib.sha256(f"provider-{name}".encode()).hexdigest()


def hold(layer, expert, residency="Warm", tps=0, blob=None, model=M):
    return HoldingInfo(model, layer, expert, residency, tps, blob)


def prov(name, *holdings, roles=("ExpertHolder",), status="Active", gpu=False, rep=500, http=None, iroh=None):
    return ProviderInfo(
        pid(name),
        roles=roles,
        status=status,
        gpu=gpu,
        iroh_endpoint_id=iroh,
        http_endpoint=http if http is not None else f"http://{name}.example/rpc",
        reputation=rep,
        holdings=tuple(holdings),
    )


def order_key(h: HolderInfo, hot: bool):
    """docs/DESIGN.md §7 holder order, written independently of the implementation."""
    return (
        RESIDENCIES.index(h.residency),
        (0 if h.gpu else 1) if hot else 0,
        -h.committed_tps,
        -h.reputation,
        h.provider,
    )


# --------------------------------------------------------------------------- policy / dataclasses


def test_policy_defaults_and_json():
    p = ReplicationPolicy()
    assert p.to_json() == {
        "min_replication": 2,
        "max_replication": 8,
        "hot_threshold_tps": 1000,
        "repair_interval_s": 120,
        "max_repairs_per_pass": 2,
    }
    assert ReplicationPolicy.from_mapping({"min_replication": 3}).min_replication == 3


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"min_replication": 0}, "min_replication"),
        ({"min_replication": 5, "max_replication": 4}, "max_replication"),
        ({"hot_threshold_tps": 0}, "hot_threshold_tps"),
        ({"repair_interval_s": 0}, "repair_interval_s"),
        ({"max_repairs_per_pass": -1}, "max_repairs_per_pass"),
        ({"min_replication": 2.5}, "min_replication"),
        ({"max_replication": True}, "max_replication"),
    ],
)
def test_policy_validate_names_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ReplicationPolicy(**kwargs)


def test_policy_from_mapping_rejects_unknown_key():
    with pytest.raises(ValueError, match="bogus"):
        ReplicationPolicy.from_mapping({"bogus": 1})


@pytest.mark.parametrize(
    "make, field",
    [
        (lambda: ProviderInfo("AB" * 32), "provider"),
        (lambda: ProviderInfo("ab" * 31), "provider"),
        (lambda: ProviderInfo(pid(1), roles=("Pilot",)), "roles"),
        (lambda: ProviderInfo(pid(1), reputation=-1), "reputation"),
        (lambda: ProviderInfo(pid(1), gpu=1), "gpu"),
        (lambda: HoldingInfo(M, 0, 0, "Hot"), "residency"),
        (lambda: HoldingInfo(M, -1, 0, "Warm"), "layer"),
        (lambda: HoldingInfo(M, 0, 0, "Warm", committed_tps=-5), "committed_tps"),
        (lambda: HoldingInfo("", 0, 0, "Warm"), "model_id"),
    ],
)
def test_dataclass_validation(make, field):
    with pytest.raises(ValueError, match=field):
        make()


def test_provider_info_normalizes_lists():
    p = ProviderInfo(pid(1), roles=["Router", "Router"], holdings=[hold(0, 0)])
    assert p.roles == ("Router",)
    assert isinstance(p.holdings, tuple)
    hash(p)  # frozen and hashable after normalization


# --------------------------------------------------------------------------- shard view


def test_view_counts_distinct_providers_roles_and_filters():
    providers = [
        prov("a", hold(0, 0), hold(0, 0, "Cold"), hold(0, 1), roles=("ExpertHolder", "Router")),
        prov("b", hold(0, 0), hold(1, 3, model="other-model"), roles=("Replica", "ExpertHolder")),
        prov("c", hold(0, 0), hold(0, 1), status="Inactive", roles=("Router",)),
        prov("d", hold(5, 5, model="other-model"), roles=("Prefill", "Decode")),
    ]
    view = ShardView.build(M, providers)
    assert view.replication(0, 0) == 2  # "a" declared it twice; "c" is inactive
    assert view.replication(0, 1) == 1
    assert view.replication(1, 3) == 0
    assert view.covered_experts() == [(0, 0), (0, 1)]
    assert view.distinct_providers() == sorted([pid("a"), pid("b")])
    assert view.role_count == {
        "Replica": 1,
        "Router": 1,
        "ExpertHolder": 2,
        "PrefillDecode": 0,
        "Prefill": 1,
        "Decode": 1,
    }
    assert set(view.role_count) == set(ROLES)
    # The duplicate declaration keeps the better (Warm) one.
    assert [h.residency for h in view.holders(0, 0) if h.provider == pid("a")] == ["Warm"]
    assert view.held_by(pid("a")) == [(0, 0), (0, 1)]
    assert view.held_by(pid("c")) == []
    assert view.provider(pid("c")) is None


def test_view_rejects_bad_input():
    with pytest.raises(ValueError, match="listed twice"):
        ShardView.build(M, [prov("a"), prov("a")])
    with pytest.raises(ValueError, match="ProviderInfo"):
        ShardView.build(M, [{"provider": pid("a")}])
    with pytest.raises(ValueError, match="model_id"):
        ShardView.build("", [])
    with pytest.raises(ValueError, match="expected"):
        ShardView.build(M, [], expected=[(0, -1)])
    with pytest.raises(TypeError):
        ShardView()


def test_under_replicated_is_catalog_aware():
    providers = [prov("a", hold(0, 0), hold(0, 1)), prov("b", hold(0, 0))]
    expected = [(0, 0), (0, 1), (0, 2)]
    view = ShardView.build(M, providers, expected=expected)
    assert view.under_replicated() == [(0, 1), (0, 2)]  # (0, 2) has zero holders
    assert not view.covers()
    assert view.covers(min_replication=1) is False
    assert view.covers([(0, 0)]) is True
    assert view.covers([(0, 0), (0, 1)], min_replication=1) is True
    # Without a catalog only covered experts are visible.
    bare = ShardView.build(M, providers)
    assert bare.under_replicated() == [(0, 1)]
    with pytest.raises(ValueError, match="expected"):
        bare.covers()


def test_evicting_listed_last_but_not_counted():
    providers = [
        prov("a", hold(0, 0, "Evicting", tps=900)),
        prov("b", hold(0, 0, "Cold")),
        prov("c", hold(0, 0, "Warm")),
    ]
    view = ShardView.build(M, providers)
    assert [h.residency for h in view.holders(0, 0)] == ["Warm", "Cold", "Evicting"]
    assert view.replication(0, 0) == 2
    assert [h.provider for h in view.holders(0, 0, allow_cold=False)] == [pid("c")]


def test_holder_order_and_hot_gpu_first():
    providers = [
        prov("cpu-fast", hold(0, 0, tps=1500), hold(0, 1, tps=500), rep=100),
        prov("gpu-slow", hold(0, 0, tps=200), hold(0, 1, tps=200), gpu=True, rep=100),
        prov("cpu-rep", hold(0, 0, tps=200), hold(0, 1, tps=200), rep=900),
        prov("cold-gpu", hold(0, 0, "Cold", tps=5000), gpu=True),
    ]
    view = ShardView.build(M, providers)
    assert view.hot_experts() == [(0, 0)]
    assert view.is_hot(0, 0) and not view.is_hot(0, 1)
    # Hot: Warm first, GPU among Warm first, then tps desc.
    assert [h.provider for h in view.holders(0, 0)] == [pid("gpu-slow"), pid("cpu-fast"), pid("cpu-rep"), pid("cold-gpu")]
    # Not hot: GPU does not matter; tps desc, then reputation desc.
    assert [h.provider for h in view.holders(0, 1)] == [pid("cpu-fast"), pid("cpu-rep"), pid("gpu-slow")]
    # Full tie falls back to provider id ascending.
    tie = ShardView.build(M, [prov(n, hold(0, 0)) for n in "xyz"])
    assert [h.provider for h in tie.holders(0, 0)] == sorted(pid(n) for n in "xyz")
    assert view.holders(9, 9) == []


def test_holder_info_fields():
    view = ShardView.build(M, [prov("a", hold(0, 0, tps=7, blob="tenzro://blob/" + "0" * 64), gpu=True, rep=42, iroh="node1")])
    (h,) = view.holders(0, 0)
    assert h == HolderInfo(pid("a"), "Warm", 7, 42, True, "node1", "http://a.example/rpc", "tenzro://blob/" + "0" * 64)


SHARD_MAP_KEYS = {
    "model_id",
    "covered_experts",
    "covered",
    "distinct_providers",
    "providers",
    "expert_holders_role_count",
    "router_role_count",
    "prefill_role_count",
    "decode_role_count",
    "replica_role_count",
    "policy",
    "under_replicated_experts",
    "hot_experts",
    "holders",
}


def test_shard_map_json_golden_shape():
    providers = [
        prov("a", hold(0, 0, tps=2000, blob="tenzro://blob/aa"), hold(0, 1), roles=("ExpertHolder", "Router"), gpu=True),
        prov("b", hold(0, 0, "Cold"), roles=("Replica", "Prefill", "Decode")),
    ]
    doc = ShardView.build(M, providers, expected=[(0, 0), (0, 1), (1, 0)]).to_json()
    assert set(doc) == SHARD_MAP_KEYS
    assert doc["model_id"] == M
    assert doc["covered_experts"] == 2
    assert doc["covered"] == [{"layer": 0, "expert": 0}, {"layer": 0, "expert": 1}]
    assert doc["distinct_providers"] == 2
    assert doc["providers"] == sorted([pid("a"), pid("b")])
    assert (doc["expert_holders_role_count"], doc["router_role_count"], doc["replica_role_count"]) == (1, 1, 1)
    assert (doc["prefill_role_count"], doc["decode_role_count"]) == (1, 1)
    assert doc["policy"] == ReplicationPolicy().to_json()
    assert doc["under_replicated_experts"] == [{"layer": 0, "expert": 1}, {"layer": 1, "expert": 0}]
    assert doc["hot_experts"] == [{"layer": 0, "expert": 0}]
    row = doc["holders"][0]
    assert set(row) == {"layer", "expert", "replication", "holders"}
    assert (row["layer"], row["expert"], row["replication"]) == (0, 0, 2)
    assert set(row["holders"][0]) == {
        "provider",
        "residency",
        "committed_tps",
        "iroh_endpoint_id",
        "http_endpoint",
        "blob_uri",
        "gpu",
    }
    assert row["holders"][0] == {
        "provider": pid("a"),
        "residency": "Warm",
        "committed_tps": 2000,
        "iroh_endpoint_id": None,
        "http_endpoint": "http://a.example/rpc",
        "blob_uri": "tenzro://blob/aa",
        "gpu": True,
    }
    assert row["holders"][1]["residency"] == "Cold"
    assert [(r["layer"], r["expert"]) for r in doc["holders"]] == [(0, 0), (0, 1)]


# --------------------------------------------------------------------------- strategies

NAMES = [f"p{i}" for i in range(8)]


@st.composite
def providers_st(draw, layers=2, experts=4):
    """Random providers holding random experts of M (and a few of another model)."""
    out = []
    for name in draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=len(NAMES), unique=True)):
        n = draw(st.integers(0, layers * experts))
        hs = [
            HoldingInfo(
                draw(st.sampled_from([M, M, M, "other"])),
                draw(st.integers(0, layers - 1)),
                draw(st.integers(0, experts - 1)),
                draw(st.sampled_from(RESIDENCIES)),
                draw(st.sampled_from([0, 10, 500, 1000, 3000])),
                draw(st.sampled_from([None, "tenzro://blob/x", "tenzro://blob/y"])),
            )
            for _ in range(n)
        ]
        out.append(
            ProviderInfo(
                pid(name),
                roles=tuple(draw(st.lists(st.sampled_from(ROLES), max_size=3))),
                status=draw(st.sampled_from(["Active", "Active", "Active", "Inactive"])),
                gpu=draw(st.booleans()),
                reputation=draw(st.sampled_from([0, 500, 1000])),
                http_endpoint=f"http://{name}/rpc",
                holdings=tuple(hs),
            )
        )
    return out


@st.composite
def routings_st(draw, layers=2, experts=4):
    tokens = draw(st.lists(st.integers(0, 200), min_size=1, max_size=40, unique=True))
    return [
        TokenRouting(
            t,
            tuple(
                draw(
                    st.lists(
                        st.tuples(st.integers(0, layers - 1), st.integers(0, experts)),
                        max_size=4,
                        unique=True,
                    )
                )
            ),
        )
        for t in tokens
    ]


PROP = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROP
@given(providers_st(), st.randoms(use_true_random=False))
def test_view_independent_of_input_order(providers, rnd):
    shuffled = list(providers)
    rnd.shuffle(shuffled)
    shuffled = [
        ProviderInfo(
            p.provider, p.roles[::-1], p.status, p.gpu, p.iroh_endpoint_id, p.http_endpoint, p.reputation, p.holdings[::-1]
        )
        for p in shuffled
    ]
    a, b = ShardView.build(M, providers), ShardView.build(M, shuffled)
    assert a.to_json() == b.to_json()
    for key in a.covered_experts():
        assert a.holders(*key) == b.holders(*key)


@PROP
@given(providers_st())
def test_view_order_and_counts_match_spec(providers):
    view = ShardView.build(M, providers)
    active = {p.provider: p for p in providers if p.status == "Active"}
    declared: dict[tuple[int, int], set[str]] = {}
    for p in active.values():
        for h in p.holdings:
            if h.model_id == M:
                declared.setdefault((h.layer, h.expert), set()).add(p.provider)
    assert view.covered_experts() == sorted(declared)
    for key, owners in declared.items():
        hs = view.holders(*key)
        assert sorted(h.provider for h in hs) == sorted(owners)  # one entry per provider
        hot = any(h.committed_tps >= 1000 for h in hs)
        assert view.is_hot(*key) == hot
        assert hs == sorted(hs, key=lambda h: order_key(h, hot))
        assert view.replication(*key) == sum(1 for h in hs if h.residency != "Evicting")
        assert view.holders(*key, allow_cold=False) == [h for h in hs if h.residency == "Warm"]
    assert view.distinct_providers() == sorted({o for owners in declared.values() for o in owners})


@PROP
@given(providers_st(), st.lists(st.sampled_from(NAMES), max_size=4))
def test_without_equals_rebuild(providers, drop_names):
    drop = {pid(n) for n in drop_names}
    expected = [(layer, e) for layer in range(2) for e in range(4)]
    view = ShardView.build(M, providers, expected=expected)
    reduced = view.without(drop)
    rebuilt = ShardView.build(M, [p for p in providers if p.provider not in drop], expected=expected)
    assert reduced.to_json() == rebuilt.to_json()
    assert reduced.under_replicated() == rebuilt.under_replicated()
    for key in rebuilt.covered_experts():
        assert reduced.holders(*key) == rebuilt.holders(*key)
    assert view.to_json() == ShardView.build(M, providers, expected=expected).to_json()  # original untouched


# --------------------------------------------------------------------------- planner


def _basic_view():
    return ShardView.build(
        M,
        [
            prov("a", hold(0, 0, tps=100), hold(0, 1), hold(0, 2, "Cold")),
            prov("b", hold(0, 0, tps=50), hold(0, 1, tps=10)),
            prov("c", hold(0, 0, "Cold", tps=999), hold(0, 2, "Cold", tps=5)),
        ],
    )


def test_plan_errors():
    view = _basic_view()
    with pytest.raises(PlanningError, match="empty"):
        plan_dispatch(view, [])
    with pytest.raises(PlanningError, match="duplicate token_index 3"):
        plan_dispatch(view, [TokenRouting(3, ((0, 0),)), TokenRouting(3, ((0, 1),))])
    with pytest.raises(PlanningError, match=r"token 1 lists expert l0/e1 twice"):
        plan_dispatch(view, [TokenRouting(1, ((0, 1), (0, 0), (0, 1)))])
    with pytest.raises(PlanningError, match="TokenRouting"):
        plan_dispatch(view, [{"token_index": 0, "experts": []}])
    with pytest.raises(PlanningError, match="split_threshold"):
        plan_dispatch(view, [TokenRouting(0, ((0, 0),))], split_threshold=0)
    with pytest.raises(PlanningError, match="token_index"):
        TokenRouting(-1, ())
    with pytest.raises(PlanningError, match="non-negative"):
        TokenRouting(0, ((0, "1"),))
    assert issubclass(PlanningError, ValueError)


def test_token_routing_normalizes():
    r = TokenRouting(4, [[0, 1], {"layer": 2, "expert": 3}])
    assert r.experts == ((0, 1), (2, 3))


def test_plan_basic_primary_backups_and_unplanned():
    view = _basic_view()
    routings = [
        TokenRouting(5, ((0, 1), (0, 0))),
        TokenRouting(2, ((0, 0), (0, 2), (0, 9))),
    ]
    plan = plan_dispatch(view, routings)
    assert isinstance(plan, DispatchPlan)
    got = [(b.layer, b.expert, b.provider, b.token_indices, [h.provider for h in b.backups]) for b in plan.batches]
    assert got == [
        (0, 0, pid("a"), [2, 5], [pid("b")]),  # Warm only: the Cold holder "c" is not a backup
        (0, 1, pid("b"), [5], [pid("a")]),
    ]
    assert plan.unplanned == [{"layer": 0, "expert": 2, "tokens": [2]}, {"layer": 0, "expert": 9, "tokens": [2]}]
    assert plan.token_assignments == [
        {
            "token_index": 2,
            "slots": [
                {"layer": 0, "expert": 0, "provider": pid("a")},
                {"layer": 0, "expert": 2, "provider": None},
                {"layer": 0, "expert": 9, "provider": None},
            ],
        },
        {
            "token_index": 5,
            "slots": [
                {"layer": 0, "expert": 1, "provider": pid("b")},
                {"layer": 0, "expert": 0, "provider": pid("a")},
            ],
        },
    ]
    cold = plan_dispatch(view, routings, allow_cold=True)
    by_key = {(b.layer, b.expert): b for b in cold.batches}
    assert [h.provider for h in by_key[(0, 0)].backups] == [pid("b"), pid("c")]
    # Both Cold: "c" commits more tps.
    assert by_key[(0, 2)].provider == pid("c") and [h.provider for h in by_key[(0, 2)].backups] == [pid("a")]
    assert cold.unplanned == [{"layer": 0, "expert": 9, "tokens": [2]}]


def test_plan_json_golden_shape():
    view = _basic_view()
    doc = plan_dispatch(view, [TokenRouting(0, ((0, 0), (0, 7)))]).to_json()
    assert set(doc) == {"model_id", "batch_count", "batches", "token_assignments", "unplanned"}
    assert doc["batch_count"] == 1
    assert doc["batches"] == [
        {
            "layer": 0,
            "expert": 0,
            "provider": pid("a"),
            "iroh_endpoint_id": None,
            "http_endpoint": "http://a.example/rpc",
            "token_indices": [0],
            "backups": [{"provider": pid("b"), "iroh_endpoint_id": None, "http_endpoint": "http://b.example/rpc"}],
        }
    ]
    assert doc["token_assignments"] == [
        {
            "token_index": 0,
            "slots": [{"layer": 0, "expert": 0, "provider": pid("a")}, {"layer": 0, "expert": 7, "provider": None}],
        }
    ]
    assert doc["unplanned"] == [{"layer": 0, "expert": 7, "tokens": [0]}]


def test_split_threshold_round_robin_over_warm_holders():
    view = ShardView.build(
        M,
        [
            prov("a", hold(0, 0, tps=30)),
            prov("b", hold(0, 0, tps=20)),
            prov("c", hold(0, 0, "Cold", tps=10)),
        ],
    )
    routings = [TokenRouting(t, ((0, 0),)) for t in range(10)]
    plan = plan_dispatch(view, routings, allow_cold=True, split_threshold=3)
    got = [(b.provider, b.token_indices, [h.provider for h in b.backups]) for b in plan.batches]
    a, b, c = pid("a"), pid("b"), pid("c")
    assert got == [
        (a, [0, 1, 2], [b, c]),
        (b, [3, 4, 5], [a, c]),
        (a, [6, 7, 8], [b, c]),
        (b, [9], [a, c]),
    ]
    slots = {x["token_index"]: x["slots"][0]["provider"] for x in plan.token_assignments}
    assert slots == {0: a, 1: a, 2: a, 3: b, 4: b, 5: b, 6: a, 7: a, 8: a, 9: b}
    # At or under the threshold nothing is split.
    assert len(plan_dispatch(view, routings, split_threshold=10).batches) == 1
    # Only Cold holders: chunks all go to the primary.
    cold_only = ShardView.build(M, [prov("c", hold(0, 0, "Cold")), prov("d", hold(0, 0, "Cold"))])
    plan = plan_dispatch(cold_only, routings, allow_cold=True, split_threshold=4)
    first, second = sorted([pid("c"), pid("d")])  # full tie: provider id decides
    assert [(x.provider, len(x.token_indices)) for x in plan.batches] == [(first, 4), (first, 4), (first, 2)]
    assert all([h.provider for h in x.backups] == [second] for x in plan.batches)


def _check_plan(view, routings, plan, allow_cold, split_threshold):
    routed = {(r.token_index, key) for r in routings for key in r.experts}
    seen = Counter()
    for b in plan.batches:
        key = (b.layer, b.expert)
        cands = view.holders(*key, allow_cold=allow_cold)
        assert cands, "batch for an expert without eligible holders"
        assert b.token_indices == sorted(b.token_indices) and b.token_indices
        assert b.provider not in {h.provider for h in b.backups}
        assert b.backups == [h for h in cands if h.provider != b.provider]
        if split_threshold is None:
            assert b.provider == cands[0].provider
        else:
            assert len(b.token_indices) <= split_threshold
            warm = [h.provider for h in cands if h.residency == "Warm"] or [cands[0].provider]
            assert b.provider in warm
        for t in b.token_indices:
            seen[(t, key)] += 1
    for u in plan.unplanned:
        key = (u["layer"], u["expert"])
        assert view.holders(*key, allow_cold=allow_cold) == []
        for t in u["tokens"]:
            seen[(t, key)] += 1
    assert set(seen) == routed and all(n == 1 for n in seen.values())
    keys = [(b.layer, b.expert, b.token_indices[0], b.provider) for b in plan.batches]
    assert keys == sorted(keys)
    # token_assignments agree with the batches.
    where = {(t, (b.layer, b.expert)): b.provider for b in plan.batches for t in b.token_indices}
    assert [a["token_index"] for a in plan.token_assignments] == sorted(r.token_index for r in routings)
    by_token = {r.token_index: r for r in routings}
    for a in plan.token_assignments:
        r = by_token[a["token_index"]]
        assert [(s["layer"], s["expert"]) for s in a["slots"]] == list(r.experts)
        for s in a["slots"]:
            assert s["provider"] == where.get((a["token_index"], (s["layer"], s["expert"])))


@PROP
@given(
    providers_st(),
    routings_st(),
    st.booleans(),
    st.one_of(st.none(), st.integers(1, 6)),
    st.randoms(use_true_random=False),
)
def test_plan_properties(providers, routings, allow_cold, split_threshold, rnd):
    view = ShardView.build(M, providers)
    plan = plan_dispatch(view, routings, allow_cold=allow_cold, split_threshold=split_threshold)
    _check_plan(view, routings, plan, allow_cold, split_threshold)
    # Same plan on a repeated call, and on another node that saw providers and routings in another order.
    again = plan_dispatch(view, routings, allow_cold=allow_cold, split_threshold=split_threshold)
    assert again.to_json() == plan.to_json()
    shuffled_p, shuffled_r = list(providers), list(routings)
    rnd.shuffle(shuffled_p)
    rnd.shuffle(shuffled_r)
    other = plan_dispatch(ShardView.build(M, shuffled_p), shuffled_r, allow_cold=allow_cold, split_threshold=split_threshold)
    assert other.to_json() == plan.to_json()


@PROP
@given(providers_st(), routings_st(), st.lists(st.sampled_from(NAMES), min_size=1, max_size=3))
def test_replan_without_failed_providers(providers, routings, failed_names):
    view = ShardView.build(M, providers)
    failed = {pid(n) for n in failed_names}
    plan = plan_dispatch(view.without(failed), routings, allow_cold=True)
    for b in plan.batches:
        assert b.provider not in failed
        assert not failed & {h.provider for h in b.backups}


# --------------------------------------------------------------------------- HRW / repair


def test_placement_score_byte_layout():
    p = pid("x")
    want = hashlib.sha256(b"tenzro/moe/placement" + b"kimi-k2-instruct/3/17" + p.encode("ascii")).digest()
    assert placement_score("kimi-k2-instruct", 3, 17, p) == want
    with pytest.raises(ValueError, match="provider"):
        placement_score(M, 0, 0, p.upper())
    with pytest.raises(ValueError, match="layer"):
        placement_score(M, -1, 0, p)


def test_rank_providers_order_and_dedupe():
    ids = [pid(i) for i in range(20)]
    ranked = rank_providers(M, 1, 2, ids + ids[:5])
    assert ranked == sorted(ids, key=lambda p: placement_score(M, 1, 2, p), reverse=True)
    assert rank_providers(M, 1, 2, reversed(ids)) == ranked
    assert rank_providers(M, 1, 3, ids) != ranked  # the key matters
    with pytest.raises(ValueError):
        rank_providers(M, 0, 0, "notalist")


def test_place_spread_and_replication():
    ids = [pid(i) for i in range(10)]
    experts = [(layer, e) for layer in range(10) for e in range(100)]
    placed = place(M, experts, ids, 1)
    counts = sorted(len(v) for v in placed.values())
    assert sum(counts) == 1000
    assert counts[0] >= 65 and counts[-1] <= 135, counts  # expected 100 each, sd ~9.5
    placed2 = place(M, experts, ids[::-1], 3)
    assert placed2 == place(M, experts, ids, 3)
    for key in experts[:50]:
        owners = sorted(p for p, ks in placed2.items() if key in ks)
        assert owners == sorted(rank_providers(M, *key, ids)[:3])
    capped = place(M, [(0, 0)], ids[:2], 5)
    assert capped == {ids[0]: [(0, 0)], ids[1]: [(0, 0)]}
    with pytest.raises(ValueError, match="replication"):
        place(M, experts, ids, 0)
    with pytest.raises(ValueError, match="empty provider"):
        place(M, experts, [], 2)


def test_plan_repair_basic():
    blob = "tenzro://blob/" + "ab" * 32
    providers = [
        prov("a", hold(0, 0, blob=blob), hold(0, 1, blob="tenzro://blob/other"), hold(0, 2, tps=5000, blob=blob)),
        prov("b", hold(0, 0, blob=blob), hold(0, 2, blob=blob)),
        prov("c", hold(0, 1, blob=blob), hold(0, 1, "Evicting")),
        prov("d", hold(0, 3, "Evicting", blob=blob)),
    ] + [prov(f"e{i}", hold(1, i)) for i in range(8)]
    expected = [(0, 0), (0, 1), (0, 2), (0, 3), (0, 4)]
    view = ShardView.build(M, providers, expected=expected)
    rows = plan_repair(view)
    by_key: dict[tuple[int, int], list[RepairRow]] = {}
    for r in rows:
        by_key.setdefault((r.layer, r.expert), []).append(r)
    assert (0, 0) not in by_key  # already at min
    assert (0, 1) not in by_key  # "c" declared it Warm and Evicting: its Warm copy counts
    # (0,2) is hot: target max_replication 8, has 2 -> 6 rows.
    assert len(by_key[(0, 2)]) == 6 and all(r.missing == 6 for r in by_key[(0, 2)])
    # (0,3): only an Evicting holder -> replication 0, 2 missing, blob from the evicting copy.
    assert len(by_key[(0, 3)]) == 2 and by_key[(0, 3)][0].blob_uri == blob
    assert pid("d") not in {r.provider for r in by_key[(0, 3)]}
    # (0,4): nobody holds it -> no blob source.
    assert len(by_key[(0, 4)]) == 2 and by_key[(0, 4)][0].blob_uri is None
    # Most urgent (lowest replication) first.
    assert [(r.layer, r.expert) for r in rows][:4] == [(0, 3), (0, 3), (0, 4), (0, 4)]
    for key, rs in by_key.items():
        ranked = rank_providers(M, *key, [p for p in view.distinct_providers() if p not in {h.provider for h in view.holders(*key)}])
        assert [r.provider for r in rs] == ranked[: len(rs)]


def test_plan_repair_blob_majority_and_candidates():
    uri_x, uri_y = "tenzro://blob/x", "tenzro://blob/y"
    providers = [
        prov("a", hold(0, 0, blob=uri_y, tps=90)),
        prov("b", hold(0, 0, blob=uri_x)),
        prov("c", hold(0, 0, blob=uri_x)),
    ]
    policy = ReplicationPolicy(min_replication=4)
    view = ShardView.build(M, providers, policy=policy)
    extra = [pid("z1"), pid("z2")]
    rows = plan_repair(view, expected=[(0, 0)], candidates=extra + [pid("a")])
    assert [r.provider for r in rows] == rank_providers(M, 0, 0, extra)[:1]
    assert rows[0].blob_uri == uri_x and rows[0].missing == 1
    assert plan_repair(view, expected=[(0, 0)]) == []  # every default candidate already holds it


def test_rows_for():
    rows = [RepairRow(M, 0, e, pid("a" if e % 2 else "b"), None, 1) for e in range(8)]
    mine = rows_for(rows, pid("a"), 2)
    assert [r.expert for r in mine] == [1, 3]
    assert rows_for(rows, pid("a"), 0) == []
    assert len(rows_for(rows, pid("b"))) == ReplicationPolicy().max_repairs_per_pass
    with pytest.raises(ValueError, match="max_repairs"):
        rows_for(rows, pid("a"), -1)


@PROP
@given(providers_st(layers=2, experts=3), st.integers(1, 4))
def test_plan_repair_properties(providers, min_rep):
    policy = ReplicationPolicy(min_replication=min_rep, max_replication=max(min_rep, 5))
    expected = [(layer, e) for layer in range(2) for e in range(3)]
    view = ShardView.build(M, providers, policy=policy, expected=expected)
    rows = plan_repair(view)
    assert rows == plan_repair(ShardView.build(M, providers[::-1], policy=policy, expected=expected))
    pool = set(view.distinct_providers())
    per_key = Counter()
    for r in rows:
        holders = {h.provider for h in view.holders(r.layer, r.expert)}
        assert r.provider not in holders
        assert r.provider in pool
        per_key[(r.layer, r.expert)] += 1
    assert len({(r.layer, r.expert, r.provider) for r in rows}) == len(rows)
    for key in expected:
        hot = view.is_hot(*key)
        target = policy.max_replication if hot else policy.min_replication
        free = pool - {h.provider for h in view.holders(*key)}
        want = max(0, min(target - view.replication(*key), len(free)))
        assert per_key[key] == want
    for p in pool:
        mine = rows_for(rows, p, policy.max_repairs_per_pass)
        assert len(mine) <= policy.max_repairs_per_pass and all(r.provider == p for r in mine)


def test_peers_spread_batches_over_equal_holders_by_planned_work():
    """With ``rank``'s peers, an unsplit batch goes to the least-loaded of the leading interchangeable
    holders (rows + 1 per batch planned so far), backups the others in order; without it,
    the first holder takes every batch it can (3 holders, 2 replicas: one of them idles)."""
    from registry.planner import plan_expert_batches

    names = ["a", "b", "c"]
    pairs = [("a", "b"), ("a", "c"), ("b", "c")] * 4  # 12 experts, each on 2 of 3 holders
    provs = {n: [] for n in names}
    for e, (x, y) in enumerate(pairs):
        provs[x].append(hold(0, e))
        provs[y].append(hold(0, e))
    view = ShardView.build(M, [prov(n, *provs[n]) for n in names])
    by_expert = {(0, e): [0, 1, 2, 3] for e in range(len(pairs))}

    alone, _, _ = plan_expert_batches(view, by_expert)
    first = Counter(b.provider for b in alone)
    assert len(first) == 2  # the view's first holder of each pair takes it: one holder idles

    spread, _, _ = plan_expert_batches(view, by_expert, rank=lambda cands: (cands, len(cands)))
    per = Counter(b.provider for b in spread)
    assert sorted(per.values()) == [4, 4, 4]
    for b in spread:  # every batch still on a holder of its expert, the other one its backup
        cands = [h.provider for h in view.holders(0, b.expert)]
        assert b.provider in cands and [h.provider for h in b.backups] == [p for p in cands if p != b.provider]

    # One peer (the first alone is interchangeable with itself): the unbalanced plan again.
    same, _, _ = plan_expert_batches(view, by_expert, rank=lambda cands: (cands, 1))
    assert [(b.expert, b.provider) for b in same] == [(b.expert, b.provider) for b in alone]

    # Rows count, not only batches: one big batch weighs as much as several small ones.
    big = {(0, 0): list(range(40)), **{(0, e): [0] for e in range(1, 4)}}  # experts 0 (a,b), 1 (a,c), 2 (b,c), 3 (a,b)
    got = {b.expert: b.provider for b in plan_expert_batches(view, big, rank=lambda cands: (cands, len(cands)))[0]}
    assert got[3] != got[0]  # expert 0's 40 rows went to one of a/b: expert 3 goes to the other
