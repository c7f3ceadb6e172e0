"""Governance of the replication policy: proposals, votes, quorum, apply, audit (docs/DESIGN.md §8).

The policy in force is the singleton ``registry.models.ReplicationPolicy`` row; it changes
only when a proposal is applied. Every step writes an ``AuditEntry``.

Electorate (who may vote on a proposal), recorded on the proposal when it is opened
(``Proposal.electorate``) and never recomputed, so a tally reads the same forever:

- ``operator``: the holder of the operator credential (docs/DESIGN.md §6), one vote, always;
- ``user:<username>``: each active Django staff user at creation (votes in the admin or the
  console). Creating a superuser later changes the electorate of later proposals only;
- ``provider:<hex64>``: each ``Active`` provider whose reputation is at least
  ``TENZRO["GOVERNANCE_MIN_VOTER_REPUTATION"]`` (``TENZRO_GOVERNANCE_MIN_REPUTATION``, default
  600) at creation. New providers start at 500; reputation rises by 1 per paid settlement and
  falls by 5 per failed batch and by the policy's ``dispute_penalty`` per upheld dispute, so a
  provider needs at least 100 paid settlements net of those before it votes (Sybil resistance:
  fresh keys never vote). Providers vote with an ed25519-signed body (``DOMAIN_VOTE``), see
  :func:`signed_vote`.

:func:`electorate` is who would vote on a proposal opened now. An elector keeps its vote on
a proposal it was recorded on even if it has since left the current electorate; an open
proposal that can no longer reach quorum is withdrawn by the operator or an admin.

Quorum rule: strict majority of the proposal's electorate, ``q = n // 2 + 1``. A proposal is
applied as soon as ``q`` electors approve; it is rejected as soon as enough electors reject
that ``q`` approvals are out of reach (``no > n - q``). Votes are final (one per voter, no
changes), so replaying a signed vote is refused. Applying merges ``changes`` over the policy
in force and validates the result; a proposal that no longer validates is rejected.
"""
from __future__ import annotations

import math
import time

from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import IntegrityError, transaction
from django.utils import timezone

from moe.identity import SignatureError, verify_body
from moe import shardmap
from registry.models import AuditEntry, Proposal, Provider, ReplicationPolicy, Vote

DOMAIN_VOTE = b"tenzro/moe/governance-vote/v1"

#: Policy fields a proposal may change, with their type.
POLICY_FIELDS: dict[str, type] = {
    "min_replication": int,
    "max_replication": int,
    "hot_threshold_tps": int,
    "repair_interval_s": int,
    "max_repairs_per_pass": int,
    "settlement_holder_share_bps": int,
    "dispute_min_overlap": float,
    "dispute_max_rel_delta": float,
    "dispute_min_rows_passed": float,
    "receipt_sample_one_in": int,
    "dispute_penalty": int,
    "quarantine_after_upheld": int,
    "quarantine_ms": int,
    "kvasir_audit_one_in": int,
}
_SHARD_FIELDS = ("min_replication", "max_replication", "hot_threshold_tps", "repair_interval_s",
                 "max_repairs_per_pass")


class GovernanceError(ValueError):
    """A governance request was refused; ``field`` names the offending input."""

    def __init__(self, message: str, field: str = "proposal"):
        super().__init__(message)
        self.field = field


def current_policy() -> ReplicationPolicy:
    """The policy row in force, created with the defaults on first use."""
    return ReplicationPolicy.objects.get_or_create(pk=1)[0]


def _values(row: ReplicationPolicy) -> dict:
    return {f: getattr(row, f) for f in POLICY_FIELDS}


def policy_json() -> dict:
    """The ``tenzro_moeReplicationPolicy`` result: every policy field, plus ``network_fee_bps``,
    ``version``, ``updated`` (ISO 8601) and ``applied_proposal`` (id or None)."""
    row = current_policy()
    out = _values(row)
    out["network_fee_bps"] = 10_000 - row.settlement_holder_share_bps
    out.update(version=row.version, updated=row.updated.isoformat(), applied_proposal=row.applied_proposal_id)
    return out


def shard_policy() -> shardmap.ReplicationPolicy:
    """The replication part of the policy in force, as the planner's dataclass."""
    row = current_policy()
    return shardmap.ReplicationPolicy(**{f: getattr(row, f) for f in _SHARD_FIELDS})


def validate_changes(changes, base: dict | None = None) -> dict:
    """Merge ``changes`` (a non-empty object of policy fields) over ``base`` and validate the whole.

    Returns the merged policy values. Raises ``GovernanceError`` naming the field
    (``changes.<field>``) for an unknown field, a wrong type or an out-of-range value.
    """
    if not isinstance(changes, dict) or not changes:
        raise GovernanceError("changes must be a non-empty object of policy fields", "changes")
    merged = dict(base if base is not None else _values(current_policy()))
    for key, value in changes.items():
        kind = POLICY_FIELDS.get(key)
        if kind is None:
            raise GovernanceError(f"unknown policy field {key!r} (known: {', '.join(POLICY_FIELDS)})",
                                  f"changes.{key}")
        if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
            raise GovernanceError(f"{key} must be {'a number' if kind is float else 'an integer'}", f"changes.{key}")
        if kind is float and not math.isfinite(value):
            raise GovernanceError(f"{key} must be finite", f"changes.{key}")
        merged[key] = kind(value)
    # Each field's own range first: the cross-field checks would otherwise name the wrong one.
    for key, lo, hi in (("min_replication", 1, 64), ("max_replication", 1, 64),
                        ("settlement_holder_share_bps", 0, 10_000), ("dispute_min_overlap", 0, 1),
                        ("dispute_max_rel_delta", 0, 1), ("dispute_min_rows_passed", 0, 1),
                        ("receipt_sample_one_in", 1, 1 << 30), ("dispute_penalty", 0, 1000),
                        ("quarantine_after_upheld", 1, 1000), ("quarantine_ms", 0, 30 * 86_400_000),
                        ("kvasir_audit_one_in", 1, 1 << 20)):
        if not lo <= merged[key] <= hi:
            raise GovernanceError(f"{key} must lie in [{lo}, {hi}], got {merged[key]}", f"changes.{key}")
    try:
        shardmap.ReplicationPolicy(**{f: merged[f] for f in _SHARD_FIELDS})
    except ValueError as exc:
        field = str(exc).split(" ", 1)[0]
        raise GovernanceError(str(exc), f"changes.{field}") from exc
    if merged["dispute_min_rows_passed"] == 0 or merged["dispute_min_overlap"] == 0:
        raise GovernanceError("dispute_min_overlap and dispute_min_rows_passed must be > 0",
                              "changes.dispute_min_overlap" if merged["dispute_min_overlap"] == 0
                              else "changes.dispute_min_rows_passed")
    return merged


def electorate() -> list[str]:
    """Voter ids of a proposal opened now (see the module doc), sorted."""
    min_rep = settings.TENZRO["GOVERNANCE_MIN_VOTER_REPUTATION"]
    users = get_user_model().objects.filter(is_staff=True, is_active=True).values_list("username", flat=True)
    providers = Provider.objects.filter(status=Provider.Status.ACTIVE, reputation__gte=min_rep)
    return sorted(["operator", *(f"user:{u}" for u in users),
                   *(f"provider:{p}" for p in providers.values_list("provider", flat=True))])


def quorum(n: int) -> int:
    """Approvals needed with ``n`` electors: a strict majority."""
    return n // 2 + 1


def tally(proposal: Proposal) -> dict:
    """``{yes, no, electorate, quorum}`` over the proposal's recorded electorate."""
    voters = set(proposal.electorate)
    yes = no = 0
    for voter, approve in proposal.votes.values_list("voter", "approve"):
        if voter in voters:
            yes, no = (yes + 1, no) if approve else (yes, no + 1)
    return {"yes": yes, "no": no, "electorate": len(voters), "quorum": quorum(len(voters))}


def proposal_json(p: Proposal) -> dict:
    """A proposal as JSON: id, title, description, changes, proposer, status, created,
    decided, ``electorate`` (voter ids recorded at creation), votes ``[{voter, approve,
    created}]`` and the ``tally``."""
    return {"id": p.pk, "title": p.title, "description": p.description, "changes": p.changes,
            "proposer": p.proposer, "status": p.status, "created": p.created.isoformat(),
            "electorate": list(p.electorate),
            "decided": p.decided.isoformat() if p.decided else None,
            "votes": [{"voter": v.voter, "approve": v.approve, "created": v.created.isoformat()}
                      for v in p.votes.all()],
            "tally": tally(p)}


def _audit(actor: str, action: str, proposal: Proposal | None, **detail) -> None:
    AuditEntry.objects.create(actor=actor, action=action, proposal=proposal, detail=detail)


def create_proposal(title: str, changes: dict, proposer: str, description: str = "") -> Proposal:
    """Open a proposal after validating ``changes`` against the policy in force, recording
    :func:`electorate` on it; audited (the audit entry lists the electorate too)."""
    if not isinstance(title, str) or not 0 < len(title.strip()) <= 200:
        raise GovernanceError("title must be a non-empty string of at most 200 characters", "title")
    validate_changes(changes)
    with transaction.atomic():
        voters = electorate()
        p = Proposal.objects.create(title=title.strip(), description=description or "", changes=changes,
                                    proposer=proposer, electorate=voters)
        _audit(proposer, AuditEntry.Action.PROPOSED, p, changes=changes, electorate=voters)
    return p


def _open(proposal_id) -> Proposal:
    try:
        p = Proposal.objects.select_for_update().get(pk=proposal_id)
    except (Proposal.DoesNotExist, ValueError, TypeError, OverflowError):
        raise GovernanceError(f"no proposal with id {proposal_id!r}", "proposal_id") from None
    if p.status != Proposal.Status.OPEN:
        raise GovernanceError(f"proposal #{p.pk} is {p.status}, not Open", "proposal_id")
    return p


def _decide(p: Proposal, actor: str) -> None:
    """Apply or reject ``p`` when its tally says so (inside the caller's transaction)."""
    t = tally(p)
    if t["yes"] >= t["quorum"]:
        row = current_policy()
        before = _values(row)
        try:
            after = validate_changes(p.changes, before)
        except GovernanceError as exc:
            p.status, p.decided = Proposal.Status.REJECTED, timezone.now()
            p.save(update_fields=["status", "decided"])
            _audit(actor, AuditEntry.Action.REJECTED, p, reason=str(exc), tally=t)
            return
        for key, value in after.items():
            setattr(row, key, value)
        row.version += 1
        row.applied_proposal = p
        row.save()
        p.status, p.decided = Proposal.Status.APPLIED, timezone.now()
        p.save(update_fields=["status", "decided"])
        _audit(actor, AuditEntry.Action.APPLIED, p, before=before, after=after, version=row.version, tally=t)
    elif t["no"] > t["electorate"] - t["quorum"]:
        p.status, p.decided = Proposal.Status.REJECTED, timezone.now()
        p.save(update_fields=["status", "decided"])
        _audit(actor, AuditEntry.Action.REJECTED, p, reason="quorum out of reach", tally=t)


def vote(proposal_id, voter: str, approve: bool) -> Proposal:
    """Record ``voter``'s final vote, then apply or reject the proposal when the tally decides it.

    Raises ``GovernanceError`` when the voter is not in the proposal's electorate, has
    already voted, or the proposal is unknown or no longer open; nothing is written then.
    """
    if not isinstance(approve, bool):
        raise GovernanceError("approve must be true or false", "approve")
    try:
        with transaction.atomic():
            p = _open(proposal_id)
            if voter not in p.electorate:
                raise GovernanceError(
                    f"{voter} is not in the electorate of proposal #{p.pk} (recorded when it was opened: the "
                    f"operator, staff users and Active providers with reputation >= "
                    f"{settings.TENZRO['GOVERNANCE_MIN_VOTER_REPUTATION']})", "voter")
            Vote.objects.create(proposal=p, voter=voter, approve=approve)
            _audit(voter, AuditEntry.Action.VOTED, p, approve=approve)
            _decide(p, voter)
    except IntegrityError:
        raise GovernanceError(f"{voter} has already voted on proposal #{proposal_id}; votes are final",
                              "voter") from None
    return Proposal.objects.get(pk=proposal_id)


def signed_vote(message, now_ms: int | None = None) -> Proposal:
    """A provider's vote: ``{body: {provider, proposal_id, approve, timestamp_ms}, signature}``.

    The body is signed under ``DOMAIN_VOTE`` (canonical JSON, like heartbeats); the
    timestamp must be within ``CLOCK_SKEW_S`` of the site clock. Raises
    ``GovernanceError`` or ``SignatureError``; nothing is written on error.
    """
    if not isinstance(message, dict) or not isinstance(message.get("body"), dict):
        raise GovernanceError("vote must be an object {body, signature}", "vote")
    body, sig = message["body"], message.get("signature")
    verify_body(body.get("provider"), DOMAIN_VOTE, body, sig if isinstance(sig, str) else "")
    ts = body.get("timestamp_ms")
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    if isinstance(ts, bool) or not isinstance(ts, int) or abs(now_ms - ts) > settings.TENZRO["CLOCK_SKEW_S"] * 1000:
        raise GovernanceError("timestamp_ms missing or too far from the site clock", "vote.body.timestamp_ms")
    pid = body.get("proposal_id")
    if isinstance(pid, bool) or not isinstance(pid, int) or not 1 <= pid < 2**31:
        raise GovernanceError("proposal_id must be a positive integer", "vote.body.proposal_id")
    return vote(pid, f"provider:{body['provider']}", body.get("approve"))


def withdraw(proposal_id, actor: str) -> Proposal:
    """Withdraw an open proposal (operator or admin); audited."""
    with transaction.atomic():
        p = _open(proposal_id)
        p.status, p.decided = Proposal.Status.WITHDRAWN, timezone.now()
        p.save(update_fields=["status", "decided"])
        _audit(actor, AuditEntry.Action.WITHDRAWN, p)
    return p


def audit_json(limit: int = 100) -> list[dict]:
    """The latest ``limit`` audit entries, newest first."""
    return [{"at": a.at.isoformat(), "actor": a.actor, "action": a.action, "proposal": a.proposal_id,
             "detail": a.detail} for a in AuditEntry.objects.all()[:limit]]


__all__ = ["DOMAIN_VOTE", "POLICY_FIELDS", "GovernanceError", "SignatureError", "audit_json", "create_proposal",
           "current_policy", "electorate", "policy_json", "proposal_json", "quorum", "shard_policy",
           "signed_vote", "tally", "validate_changes", "vote", "withdraw"]
