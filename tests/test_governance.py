"""Governance: the policy changes only through proposals that reach quorum; audited; admin and API operable."""
from __future__ import annotations

import json
import time

import pytest
from django.contrib.auth import get_user_model
from nacl.signing import SigningKey

from moe.identity import SignatureError, provider_id, sign_body
from registry import governance
from registry.governance import DOMAIN_VOTE, GovernanceError
from registry.heartbeat import ingest
from registry.models import AuditEntry, Proposal, Provider, ReplicationPolicy, Vote
from registry.selectors import shard_view
from registry.operator import operator_token
from tests.conftest import signed_heartbeat

pytestmark = pytest.mark.django_db


def voter_provider(seed: int, reputation: int = 700) -> SigningKey:
    key = SigningKey(bytes([seed]) * 32)
    ingest(signed_heartbeat(key, []))
    Provider.objects.filter(provider=provider_id(key)).update(reputation=reputation)
    return key


def signed_vote(key: SigningKey, proposal_id: int, approve: bool, ts_ms: int | None = None) -> dict:
    body = {"provider": provider_id(key), "proposal_id": proposal_id, "approve": approve,
            "timestamp_ms": ts_ms or int(time.time() * 1000)}
    return {"body": body, "signature": sign_body(key, DOMAIN_VOTE, body)}


def policy_state():
    return (json.dumps(governance.policy_json(), sort_keys=True, default=str),
            sorted(Proposal.objects.values_list("id", "status")), Vote.objects.count())


def test_defaults_and_shard_view_uses_policy_in_force():
    pol = governance.policy_json()
    assert {k: pol[k] for k in ("min_replication", "max_replication", "hot_threshold_tps", "repair_interval_s",
                                "max_repairs_per_pass")} == {"min_replication": 2, "max_replication": 8,
                                                             "hot_threshold_tps": 1000, "repair_interval_s": 120,
                                                             "max_repairs_per_pass": 2}
    assert pol["settlement_holder_share_bps"] + pol["network_fee_bps"] == 10_000
    assert (pol["dispute_min_overlap"], pol["dispute_max_rel_delta"], pol["dispute_min_rows_passed"]) == (0.75, 0.05, 0.9)
    assert pol["version"] == 1 and pol["applied_proposal"] is None
    p = governance.create_proposal("min 1", {"min_replication": 1, "hot_threshold_tps": 50}, "operator")
    governance.vote(p.pk, "operator", True)  # electorate {operator}: quorum 1
    assert Proposal.objects.get(pk=p.pk).status == "Applied"
    view = shard_view("anything")
    assert (view.policy.min_replication, view.policy.hot_threshold_tps) == (1, 50)
    assert governance.policy_json()["version"] == 2
    actions = list(AuditEntry.objects.order_by("id").values_list("action", flat=True))
    assert actions == ["proposed", "voted", "applied"]
    applied = AuditEntry.objects.get(action="applied").detail
    assert applied["before"]["min_replication"] == 2 and applied["after"]["min_replication"] == 1


@pytest.mark.parametrize("changes, field", [
    ({}, "changes"), ({"bogus": 1}, "changes.bogus"), ({"min_replication": 0}, "changes.min_replication"),
    ({"min_replication": 9}, "changes.max_replication"), ({"min_replication": True}, "changes.min_replication"),
    ({"min_replication": 10**26}, "changes.min_replication"),  # its own range, not "max_replication must be >= ..."
    ({"settlement_holder_share_bps": 10_001}, "changes.settlement_holder_share_bps"),
    ({"dispute_min_overlap": 1.5}, "changes.dispute_min_overlap"),
    ({"dispute_max_rel_delta": float("nan")}, "changes.dispute_max_rel_delta"),
    ({"repair_interval_s": 0}, "changes.repair_interval_s"),
])
def test_invalid_proposals_are_refused_and_change_nothing(changes, field):
    before = policy_state()
    with pytest.raises(GovernanceError) as err:
        governance.create_proposal("bad", changes, "operator")
    assert err.value.field == field
    assert policy_state() == before and not AuditEntry.objects.exists()


def test_quorum_is_a_strict_majority_of_operator_staff_and_reputable_providers():
    User = get_user_model()
    User.objects.create_user("alice", is_staff=True)
    User.objects.create_user("bob", is_staff=True)
    User.objects.create_user("carol", is_staff=False)  # not staff: no vote
    k1, k2 = voter_provider(1), voter_provider(2)
    voter_provider(3, reputation=500)  # fresh reputation: no vote
    elect = governance.electorate()
    assert elect == sorted(["operator", "user:alice", "user:bob", f"provider:{provider_id(k1)}",
                            f"provider:{provider_id(k2)}"])
    assert governance.quorum(len(elect)) == 3
    p = governance.create_proposal("max 6", {"max_replication": 6}, "user:alice")
    with pytest.raises(GovernanceError, match="not in the electorate"):
        governance.vote(p.pk, "user:carol", True)
    governance.vote(p.pk, "user:alice", True)
    governance.signed_vote(signed_vote(k1, p.pk, True))
    assert Proposal.objects.get(pk=p.pk).status == "Open" and governance.policy_json()["max_replication"] == 8
    with pytest.raises(GovernanceError, match="already voted"):
        governance.vote(p.pk, "user:alice", False)  # votes are final
    governance.vote(p.pk, "operator", True)  # third approval: applied
    assert Proposal.objects.get(pk=p.pk).status == "Applied"
    assert governance.policy_json()["max_replication"] == 6
    with pytest.raises(GovernanceError, match="not Open"):
        governance.vote(p.pk, "user:bob", True)


def test_rejection_when_quorum_is_out_of_reach_and_stale_proposals():
    get_user_model().objects.create_user("alice", is_staff=True)
    p = governance.create_proposal("min 3", {"min_replication": 3}, "operator")
    governance.vote(p.pk, "operator", False)  # 2 electors, quorum 2: one "no" makes it unreachable
    assert Proposal.objects.get(pk=p.pk).status == "Rejected"
    assert governance.policy_json()["min_replication"] == 2
    # Two proposals valid alone but not together: the second is rejected when applied.
    a = governance.create_proposal("max 3", {"max_replication": 3}, "operator")
    b = governance.create_proposal("min 4", {"min_replication": 4}, "operator")
    for pid in (a.pk, b.pk):
        governance.vote(pid, "operator", True)
        governance.vote(pid, "user:alice", True)
    assert Proposal.objects.get(pk=a.pk).status == "Applied"
    assert Proposal.objects.get(pk=b.pk).status == "Rejected"
    assert (governance.policy_json()["min_replication"], governance.policy_json()["max_replication"]) == (2, 3)


def test_signed_votes_replayed_forged_or_stale_are_refused():
    k1 = voter_provider(1)
    other = SigningKey(b"\x09" * 32)
    get_user_model().objects.create_user("alice", is_staff=True)  # electorate of 3: one vote does not decide
    p = governance.create_proposal("hot 2000", {"hot_threshold_tps": 2000}, "operator")
    forged = signed_vote(k1, p.pk, True)
    forged["signature"] = signed_vote(other, p.pk, True)["signature"]
    with pytest.raises(SignatureError):
        governance.signed_vote(forged)
    with pytest.raises(GovernanceError, match="site clock"):
        governance.signed_vote(signed_vote(k1, p.pk, True, ts_ms=int(time.time() * 1000) - 300_000))
    before = policy_state()
    assert before[2] == 0
    msg = signed_vote(k1, p.pk, True)
    governance.signed_vote(msg)
    with pytest.raises(GovernanceError, match="already voted"):
        governance.signed_vote(msg)
    assert Vote.objects.count() == 1
    with pytest.raises(GovernanceError, match="not in the electorate"):
        governance.signed_vote(signed_vote(other, p.pk, True))
    with pytest.raises(GovernanceError, match="positive integer"):
        governance.signed_vote(signed_vote(k1, 2**70, True))  # would overflow the id column


def test_the_electorate_is_recorded_when_a_proposal_opens_and_stays():
    """A superuser created later neither turns an old "1 of 1" into "1 of 2" nor votes on it."""
    User = get_user_model()
    old = governance.create_proposal("repairs 4", {"max_repairs_per_pass": 4}, "operator")
    governance.vote(old.pk, "operator", True)
    assert Proposal.objects.get(pk=old.pk).status == "Applied"
    User.objects.create_superuser("root", password="pw")
    assert governance.tally(Proposal.objects.get(pk=old.pk)) == {"yes": 1, "no": 0, "electorate": 1, "quorum": 1}
    assert governance.proposal_json(Proposal.objects.get(pk=old.pk))["electorate"] == ["operator"]

    opened = governance.create_proposal("interval 60", {"repair_interval_s": 60}, "operator")
    assert opened.electorate == ["operator", "user:root"]
    User.objects.create_user("late", is_staff=True)
    k1 = voter_provider(1)  # reputable, but after the proposal opened
    with pytest.raises(GovernanceError, match="not in the electorate of proposal"):
        governance.vote(opened.pk, "user:late", True)
    with pytest.raises(GovernanceError, match="not in the electorate of proposal"):
        governance.signed_vote(signed_vote(k1, opened.pk, True))
    root = User.objects.get(username="root")
    root.is_staff = False  # leaving the electorate now does not shrink this proposal's
    root.save()
    governance.vote(opened.pk, "operator", True)
    assert Proposal.objects.get(pk=opened.pk).status == "Open"  # 1 of 2: quorum 2
    governance.vote(opened.pk, "user:root", True)
    assert Proposal.objects.get(pk=opened.pk).status == "Applied"
    audit = AuditEntry.objects.filter(proposal=opened, action="proposed").get().detail
    assert audit["electorate"] == ["operator", "user:root"]


def test_withdraw():
    q = governance.create_proposal("interval 60", {"repair_interval_s": 60}, "operator")
    assert governance.withdraw(q.pk, "operator").status == "Withdrawn"
    with pytest.raises(GovernanceError, match="not Open"):
        governance.withdraw(q.pk, "operator")
    with pytest.raises(GovernanceError, match="no proposal"):
        governance.vote(9999, "operator", True)


def test_rpc_governance_methods_need_the_operator_where_they_mutate(client):
    def rpc(method, params, token=None):
        headers = {"HTTP_AUTHORIZATION": f"Bearer {token}"} if token else {}
        r = client.post("/rpc", json.dumps({"jsonrpc": "2.0", "id": 1, "method": method, "params": params}),
                        content_type="application/json", **headers)
        return r.json()

    tok = operator_token()
    assert rpc("tenzro_moeCreateProposal", {"title": "t", "changes": {"min_replication": 3}})["error"]["code"] == -32001
    bad = rpc("tenzro_moeCreateProposal", {"title": "t", "changes": {"min_replication": 0}}, tok)["error"]
    assert bad["code"] == -32602 and bad["data"]["field"] == "changes.min_replication"
    created = rpc("tenzro_moeCreateProposal", {"title": "t", "changes": {"min_replication": 3}}, tok)["result"]
    pid = created["id"]
    assert created["status"] == "Open" and created["tally"] == {"yes": 0, "no": 0, "electorate": 1, "quorum": 1}
    refused = rpc("tenzro_moeVoteProposal", {"proposal_id": pid, "approve": True})["error"]
    assert refused["code"] == -32001 and refused["data"]["field"] == "Authorization"
    assert rpc("tenzro_moeVoteProposal", {"proposal_id": pid, "approve": True}, tok)["result"]["status"] == "Applied"
    assert rpc("tenzro_moeReplicationPolicy", [])["result"]["min_replication"] == 3
    assert rpc("tenzro_moeListProposals", {})["result"]["count"] == 1
    assert rpc("tenzro_moeGetProposal", {"proposal_id": 12345})["error"]["data"]["field"] == "proposal_id"
    entries = rpc("tenzro_moeGovernanceAudit", {"limit": 10})["result"]["entries"]
    assert [e["action"] for e in entries] == ["applied", "voted", "proposed"]
    assert rpc("tenzro_moeWithdrawProposal", {"proposal_id": pid}, tok)["error"]["data"]["field"] == "proposal_id"


def test_rest_governance_endpoints(client):
    auth = {"HTTP_AUTHORIZATION": f"Bearer {operator_token()}"}
    body = json.dumps({"title": "hot", "changes": {"hot_threshold_tps": 10}})
    assert client.post("/api/v1/proposals", body, content_type="application/json").status_code == 403
    made = client.post("/api/v1/proposals", body, content_type="application/json", **auth)
    assert made.status_code == 200
    pid = made.json()["id"]
    bad = client.post("/api/v1/proposals", json.dumps({"title": "x", "changes": {"nope": 1}}),
                      content_type="application/json", **auth)
    assert bad.status_code == 400 and bad.json()["field"] == "changes.nope"
    anon_vote = client.post(f"/api/v1/proposals/{pid}/vote", json.dumps({"approve": True}),
                            content_type="application/json")
    assert anon_vote.status_code == 403
    ok = client.post(f"/api/v1/proposals/{pid}/vote", json.dumps({"approve": True}),
                     content_type="application/json", **auth)
    assert ok.status_code == 200 and ok.json()["status"] == "Applied"
    again = client.post(f"/api/v1/proposals/{pid}/vote", json.dumps({"approve": True}),
                        content_type="application/json", **auth)
    assert again.status_code == 409
    assert client.get("/api/v1/policy").json()["hot_threshold_tps"] == 10
    assert client.get(f"/api/v1/proposals/{pid}").json()["votes"][0]["voter"] == "operator"
    assert client.get("/api/v1/proposals/999").status_code == 404
    assert client.get("/api/v1/proposals", {"status": "Applied"}).json()["count"] == 1
    assert client.get("/api/v1/governance/audit").json()["entries"][0]["action"] == "applied"
    assert client.post(f"/api/v1/proposals/{pid}/withdraw", **auth).status_code == 409


def test_admin_lists_every_registry_model_and_votes_with_actions(client):
    admin = get_user_model().objects.create_superuser("root", "root@example.org", "pw")
    client.force_login(admin)
    ingest(signed_heartbeat(SigningKey(b"\x05" * 32), [{"model_id": "m", "layer": 0, "experts": "0-3"}]))
    p = governance.create_proposal("share", {"settlement_holder_share_bps": 8000}, "operator")
    for url in ("provider", "holding", "moemodel", "replicationpolicy", "proposal", "vote", "auditentry"):
        assert client.get(f"/admin/registry/{url}/").status_code == 200, url
    assert client.get(f"/admin/registry/proposal/{p.pk}/change/").status_code == 200
    # Electorate {operator, user:root}: root's yes is 1 of quorum 2, the operator's makes it.
    r = client.post("/admin/registry/proposal/", {"action": "vote_yes", "_selected_action": [p.pk]})
    assert r.status_code == 302 and Vote.objects.get().voter == "user:root"
    governance.vote(p.pk, "operator", True)
    assert ReplicationPolicy.objects.get().settlement_holder_share_bps == 8000
    add = client.post("/admin/registry/proposal/add/", {"title": "bad", "description": "",
                                                        "changes": '{"min_replication": 0}'})
    assert add.status_code == 200 and Proposal.objects.count() == 1  # form error, nothing created
    add = client.post("/admin/registry/proposal/add/", {"title": "ok", "description": "",
                                                        "changes": '{"min_replication": 3}'})
    assert add.status_code == 302 and Proposal.objects.latest("id").proposer == "user:root"
    assert AuditEntry.objects.filter(action="proposed", actor="user:root").exists()
