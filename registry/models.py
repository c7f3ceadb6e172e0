"""Registry records: providers, the experts they hold, and the models the site knows."""
from __future__ import annotations

import secrets

from django.db import models

from moe.content import blob_uri
from moe.shardmap import RESIDENCIES


def new_holdings_version() -> int:
    """A fresh random 62-bit token (unique across rows and across rolled-back transactions)."""
    return secrets.randbits(62)


class Provider(models.Model):
    """A node identified by its ed25519 public key (64 lowercase hex), kept current by heartbeats.

    ``connected`` is true while the provider's agent WebSocket is open on some site process;
    ``last_heartbeat_ms`` (unix milliseconds of the last accepted signed heartbeat) is
    strictly increasing, which rejects replays. ``holdings_version`` is a random token replaced
    whenever the provider's holding rows change (heartbeat ingest is their only writer; rows
    inserted outside Django get 0); the shard-view cache (``registry.selectors``) keys on it.
    """

    class Status(models.TextChoices):
        ACTIVE = "Active"
        INACTIVE = "Inactive"
        SUSPENDED = "Suspended"

    provider = models.CharField(max_length=64, primary_key=True)
    name = models.CharField(max_length=200, blank=True, default="")
    http_endpoint = models.CharField(max_length=500, blank=True, default="")
    iroh_endpoint_id = models.CharField(max_length=200, blank=True, default="")
    # Direct "ip:port" addresses of the iroh endpoint (no relays or discovery: routers dial these).
    iroh_addrs = models.JSONField(default=list, blank=True, db_default=[])
    roles = models.JSONField(default=list, blank=True)
    moe_gpu = models.BooleanField(default=False)
    price_per_input_token = models.BigIntegerField(default=10)
    minimum_price = models.BigIntegerField(default=100)
    reputation = models.IntegerField(default=500)
    # Data-plane record of this provider as a holder (written by record_holder_outcomes).
    batches_served = models.BigIntegerField(default=0, db_default=0)
    batch_failures = models.BigIntegerField(default=0, db_default=0)
    latency_ms_ewma = models.FloatField(default=0.0, db_default=0.0)
    # When the router last saw a batch of this holder fail / succeed (``registry.selectors.provider_state``).
    last_failure = models.DateTimeField(null=True, blank=True)
    last_success = models.DateTimeField(null=True, blank=True)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.ACTIVE)
    connected = models.BooleanField(default=False)
    agent_channel = models.CharField(max_length=200, blank=True, default="")
    last_heartbeat = models.DateTimeField(null=True, blank=True)
    last_heartbeat_ms = models.BigIntegerField(default=0)
    holdings_version = models.BigIntegerField(default=new_holdings_version, db_default=0)
    # Economy (settlement app): credited holder amounts, upheld-dispute streak, quarantine end
    # (unix ms; the shard view and planner skip the provider until then).
    balance = models.BigIntegerField(default=0, db_default=0)
    dispute_streak = models.PositiveIntegerField(default=0, db_default=0)
    quarantined_until_ms = models.BigIntegerField(default=0, db_default=0)
    created = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["provider"]

    def __str__(self) -> str:
        return f"{self.name or 'provider'} {self.provider[:12]}…"


class Holding(models.Model):
    """A provider's declaration that it holds one expert (``expert == num_experts``: shared slot)."""

    provider = models.ForeignKey(Provider, on_delete=models.CASCADE, related_name="holdings")
    model_id = models.CharField(max_length=200)
    layer = models.PositiveIntegerField()
    expert = models.PositiveIntegerField()
    residency = models.CharField(max_length=16, choices=[(r, r) for r in RESIDENCIES], default="Warm")
    committed_tps = models.PositiveIntegerField(default=0)
    blob_uri = models.CharField(max_length=200, blank=True, default="")

    class Meta:
        ordering = ["model_id", "layer", "expert", "provider"]
        constraints = [
            models.UniqueConstraint(fields=["provider", "model_id", "layer", "expert"], name="one_holding_per_expert")
        ]
        indexes = [models.Index(fields=["model_id", "layer", "expert"])]

    def __str__(self) -> str:
        return f"{self.model_id} l{self.layer}/e{self.expert} @ {self.provider_id[:12]}"


class MoeModel(models.Model):
    """A model whose experts are published on this site: its MoE shape, from its HF config.

    ``moe_layers`` lists the MoE layer indices; ``num_experts`` counts routed experts; the
    shared expert (when ``n_shared_experts > 0``) is the extra slot ``num_experts``.
    """

    model_id = models.CharField(max_length=200, primary_key=True)
    family = models.CharField(max_length=50)
    num_experts = models.PositiveIntegerField()
    top_k = models.PositiveIntegerField()
    n_shared_experts = models.PositiveIntegerField(default=0)
    hidden_size = models.PositiveIntegerField()
    expert_d_ff = models.PositiveIntegerField()
    moe_layers = models.JSONField(default=list)
    config = models.JSONField(default=dict)
    source = models.CharField(max_length=1000, blank=True, default="")
    created = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return self.model_id

    def expert_keys(self) -> list[tuple[int, int]]:
        """Every (layer, expert) slot of the model, shared slot included."""
        slots = self.num_experts + (1 if self.n_shared_experts else 0)
        return [(layer, e) for layer in self.moe_layers for e in range(slots)]


class ReplicationPolicy(models.Model):
    """The policy in force (a singleton, ``pk = 1``), changed only by applying a proposal.

    Replication/repair fields are those of ``moe.shardmap.ReplicationPolicy`` (docs/DESIGN.md §8);
    settlement split: ``settlement_holder_share_bps`` (basis points of a holder's charge paid
    to the holder; the network fee is the remaining ``10000 - share``); dispute tolerances
    (reference §7.5, docs/DESIGN.md §7): a re-executed row passes when its top-feature overlap is
    ``≥ dispute_min_overlap`` and its relative delta ``≤ dispute_max_rel_delta``; a
    commitment passes when ``≥ dispute_min_rows_passed`` of its rows pass. Receipts economy
    (docs/DESIGN.md §7): a verified batch is kept when ``HMAC(router secret, commitment) mod
    receipt_sample_one_in == 0``; an upheld dispute costs ``dispute_penalty`` reputation and
    ``quarantine_after_upheld`` upheld disputes in a row quarantine the provider for
    ``quarantine_ms``. ``version`` counts applied changes. Read and validate through ``registry.governance``.
    """

    id = models.PositiveSmallIntegerField(primary_key=True, default=1, editable=False)
    min_replication = models.PositiveIntegerField(default=2)
    max_replication = models.PositiveIntegerField(default=8)
    hot_threshold_tps = models.PositiveIntegerField(default=1000)
    repair_interval_s = models.PositiveIntegerField(default=120)
    max_repairs_per_pass = models.PositiveIntegerField(default=2)
    settlement_holder_share_bps = models.PositiveIntegerField(default=9000)
    dispute_min_overlap = models.FloatField(default=0.75)
    dispute_max_rel_delta = models.FloatField(default=0.05)
    dispute_min_rows_passed = models.FloatField(default=0.9)
    receipt_sample_one_in = models.PositiveIntegerField(default=64, db_default=64)
    dispute_penalty = models.PositiveIntegerField(default=15, db_default=15)
    quarantine_after_upheld = models.PositiveIntegerField(default=3, db_default=3)
    quarantine_ms = models.BigIntegerField(default=300_000, db_default=300_000)
    # Receiptless Kvasir workers: about one in this many of a worker's batches is re-executed
    # on a trusted executor and compared under the dispute tolerances (issue 27 item 5).
    kvasir_audit_one_in = models.PositiveIntegerField(default=8, db_default=8)
    version = models.PositiveIntegerField(default=1)
    updated = models.DateTimeField(auto_now=True)
    applied_proposal = models.ForeignKey("Proposal", null=True, blank=True, on_delete=models.SET_NULL,
                                         related_name="+")

    class Meta:
        verbose_name = "replication policy"
        verbose_name_plural = "replication policy"

    def __str__(self) -> str:
        return f"policy v{self.version}"


class Proposal(models.Model):
    """A proposed change to the policy: ``changes`` maps policy fields to new values.

    Lifecycle: ``Open`` → ``Applied`` (approvals reached quorum; the change was written) or
    ``Rejected`` (rejections made quorum unreachable, or the change no longer validates
    against the policy in force) or ``Withdrawn`` (by the operator or an admin).
    ``electorate``: the sorted voter ids that may vote on it, recorded when it is opened
    (``registry.governance``); its quorum is a strict majority of them.
    """

    class Status(models.TextChoices):
        OPEN = "Open"
        APPLIED = "Applied"
        REJECTED = "Rejected"
        WITHDRAWN = "Withdrawn"

    title = models.CharField(max_length=200)
    description = models.TextField(blank=True, default="")
    changes = models.JSONField()
    proposer = models.CharField(max_length=100)
    electorate = models.JSONField(default=list, blank=True)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.OPEN)
    created = models.DateTimeField(auto_now_add=True)
    decided = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-id"]

    def __str__(self) -> str:
        return f"#{self.pk} {self.title}"


class Vote(models.Model):
    """One voter's approval or rejection of a proposal (voter ids: see ``registry.governance``)."""

    proposal = models.ForeignKey(Proposal, on_delete=models.CASCADE, related_name="votes")
    voter = models.CharField(max_length=100)
    approve = models.BooleanField()
    created = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["proposal", "created", "voter"]
        constraints = [models.UniqueConstraint(fields=["proposal", "voter"], name="one_vote_per_voter")]

    def __str__(self) -> str:
        return f"{self.voter} {'yes' if self.approve else 'no'} on #{self.proposal_id}"


class AuditEntry(models.Model):
    """Append-only governance audit trail: who did what to which proposal, and the policy before/after."""

    class Action(models.TextChoices):
        PROPOSED = "proposed"
        VOTED = "voted"
        APPLIED = "applied"
        REJECTED = "rejected"
        WITHDRAWN = "withdrawn"

    at = models.DateTimeField(auto_now_add=True)
    actor = models.CharField(max_length=100)
    action = models.CharField(max_length=16, choices=Action.choices)
    proposal = models.ForeignKey(Proposal, null=True, blank=True, on_delete=models.SET_NULL, related_name="audit")
    detail = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["-at", "-id"]
        verbose_name_plural = "audit entries"

    def __str__(self) -> str:
        return f"{self.at:%Y-%m-%d %H:%M:%S} {self.actor} {self.action}"


class AgentSession(models.Model):
    """One open agent WebSocket of a provider (a provider may briefly have two while it reconnects).

    ``Provider.connected`` is true exactly while at least one session exists, so closing a
    duplicate socket never drops a provider whose other socket is still open.
    """

    provider = models.ForeignKey(Provider, on_delete=models.CASCADE, related_name="sessions")
    channel_name = models.CharField(max_length=200, unique=True)
    opened = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"{self.provider_id[:12]}… on {self.channel_name}"


class ExpertBlob(models.Model):
    """The blob of one expert's FFN weights (``tenzro://blob/<blake3>``) for a model layer."""

    model_id = models.CharField(max_length=200)
    layer = models.PositiveIntegerField()
    expert = models.PositiveIntegerField()
    blob_hash = models.CharField(max_length=64)
    nbytes = models.BigIntegerField()
    quant = models.CharField(max_length=32, default="f32")
    created = models.DateTimeField(auto_now_add=True)

    class Meta:
        db_table = "prepare_expertblob"  # created by prepare 0001; the catalog owns it since registry 0005
        ordering = ["model_id", "layer", "expert"]
        constraints = [models.UniqueConstraint(fields=["model_id", "layer", "expert"], name="one_blob_per_expert")]

    @property
    def blob_uri(self) -> str:
        """``tenzro://blob/<hash>``."""
        return blob_uri(self.blob_hash)


class GateBlob(models.Model):
    """The self-describing gate (router) blob of one MoE layer."""

    model_id = models.CharField(max_length=200)
    layer = models.PositiveIntegerField()
    blob_hash = models.CharField(max_length=64)
    created = models.DateTimeField(auto_now_add=True)

    class Meta:
        db_table = "prepare_gateblob"
        ordering = ["model_id", "layer"]
        constraints = [models.UniqueConstraint(fields=["model_id", "layer"], name="one_gate_per_layer")]

    @property
    def blob_uri(self) -> str:
        """``tenzro://blob/<hash>``."""
        return blob_uri(self.blob_hash)


class RepairPass(models.Model):
    """One scheduled repair pass (docs/DESIGN.md §8): the plan offered to agents and what they did.

    ``period_key`` is the idempotency key ``"<interval_s>:<period>"`` with ``period =
    floor(unix seconds / interval_s)``; its unique constraint makes two beats, a retried task
    or a slow pass run one period at most once (the loser only bumps ``attempts``).
    ``rows``: the plan (``RepairRow.to_json`` plus ``kind`` "repair"/"hot"); ``accepted`` /
    ``declined``: ``[{provider, layer, expert, model_id, reason?}]`` as agents reported them;
    ``fetched_bytes``: blob bytes agents pulled; ``duration_ms``: wall time of the pass.
    """

    class Status(models.TextChoices):
        RUNNING = "running"
        DONE = "done"
        FAILED = "failed"

    period_key = models.CharField(max_length=64, unique=True)
    period = models.BigIntegerField()
    interval_s = models.PositiveIntegerField()
    source = models.CharField(max_length=32, default="timer")
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.RUNNING)
    attempts = models.PositiveIntegerField(default=1)
    models_planned = models.JSONField(default=list, blank=True)
    rows = models.JSONField(default=list, blank=True)
    accepted = models.JSONField(default=list, blank=True)
    declined = models.JSONField(default=list, blank=True)
    released = models.JSONField(default=list, blank=True)
    offered_to = models.PositiveIntegerField(default=0)
    fetched_bytes = models.BigIntegerField(default=0)
    duration_ms = models.FloatField(default=0.0)
    error = models.TextField(blank=True, default="")
    started = models.DateTimeField(auto_now_add=True)
    finished = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-period"]
        verbose_name_plural = "repair passes"

    def __str__(self) -> str:
        return f"repair pass {self.period_key} ({self.status})"


class MarketModel(models.Model):
    """A catalog model listed on the expert-coverage market (Kvasir contract §1.3–1.4).

    ``n_layer`` is the block count (echoed to workers), ``expert_layers`` the layers whose
    experts the market offers; ``name`` is an alternative reference (``model=`` queries).
    """

    model_id = models.CharField(max_length=200, primary_key=True)
    name = models.CharField(max_length=200, blank=True, default="")
    n_embd = models.PositiveIntegerField()
    n_layer = models.PositiveIntegerField()
    n_expert = models.PositiveIntegerField()
    expert_layers = models.JSONField(default=list)
    created = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["created", "model_id"]

    def __str__(self) -> str:
        return self.model_id


class MarketWorker(models.Model):
    """The last coverage post of one market worker (contract §1.5); live for 120 s after ``ts``."""

    worker_id = models.CharField(max_length=200, primary_key=True)
    wallet = models.CharField(max_length=64, blank=True, default="")
    model = models.CharField(max_length=200)
    n_layer = models.IntegerField(default=0)
    n_expert = models.IntegerField(default=0)
    segments = models.JSONField(default=list, blank=True)
    url = models.CharField(max_length=300, blank=True, default="")
    owner = models.CharField(max_length=64, blank=True, default="")
    platform = models.JSONField(default=dict, blank=True)
    ts = models.DateTimeField()
    # Relay wiring (contract §1.5): session name and coordinator port, sticky to the worker until
    # it is evicted; relay_ts = its last relay-wired coverage post (the dispatch map's staleness).
    session = models.CharField(max_length=128, blank=True, default="")
    listen_port = models.IntegerField(null=True, blank=True, unique=True)
    relay_claimed = models.DateTimeField(null=True, blank=True)
    relay_ts = models.DateTimeField(null=True, blank=True)
    # The relay socket (contract §1.8): whether a site process holds it now, the bytes it carried
    # each way since it first joined, and how many of those bytes were already credited.
    relay_connected = models.BooleanField(default=False)
    relay_channel = models.CharField(max_length=200, blank=True, default="")  # the socket holding it (newest wins)
    relay_ws2tcp = models.BigIntegerField(default=0)
    relay_tcp2ws = models.BigIntegerField(default=0)
    relay_credited = models.BigIntegerField(default=0)

    def __str__(self) -> str:
        return self.worker_id


class MarketCredit(models.Model):
    """Relay bytes credited to a session owner's wallet (contract §1.8): ``units`` =
    Σ fresh max(ws→tcp, tcp→ws) bytes / 1e6 × ``TENZRO_MARKET_RELAY_UNITS_PER_MB``."""

    wallet = models.CharField(max_length=64, primary_key=True)
    bytes = models.BigIntegerField(default=0)
    units = models.FloatField(default=0.0)
    updated = models.DateTimeField(auto_now=True)


class MarketFraud(models.Model):
    """A fraud proof against a receiptless Kvasir worker (issue 27 item 5): one audited batch whose
    re-execution by ``executed_by`` ("site" = the fallback replica, or a holder's provider id)
    failed the worker's rows under the dispute tolerances. The worker id and its wallet are
    quarantined until ``quarantined_until`` (coverage ignored, relay refused)."""

    worker_id = models.CharField(max_length=200, db_index=True)
    wallet = models.CharField(max_length=64, blank=True, default="", db_index=True)
    model_id = models.CharField(max_length=200)
    layer = models.IntegerField()
    expert = models.IntegerField()
    tokens = models.JSONField(default=list)
    verification = models.JSONField(default=dict)
    executed_by = models.CharField(max_length=64)
    created = models.DateTimeField()
    quarantined_until = models.DateTimeField(db_index=True)

    class Meta:
        ordering = ["-id"]

    def __str__(self) -> str:
        return f"fraud by {self.worker_id} l{self.layer}/e{self.expert}"


class MarketChallenge(models.Model):
    """An outstanding auth nonce (contract §2): bound to ``wallet``, single use, 5 minutes."""

    nonce = models.CharField(max_length=32, primary_key=True)
    wallet = models.CharField(max_length=64)
    created = models.DateTimeField()


class MarketClaim(models.Model):
    """A pending volunteer assignment (contract §1.11 item 3): one replica of the range for 120 s."""

    wallet = models.CharField(max_length=64)
    model = models.CharField(max_length=200)
    layer = models.IntegerField()
    begin = models.IntegerField()
    end = models.IntegerField()
    ts = models.DateTimeField()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["wallet", "model", "layer", "begin", "end"],
                                               name="one_claim_per_range")]


class Deployment(models.Model):
    """The one deployment a database belongs to: a single row (pk 1) naming it.

    Every site process, worker and local cluster claims it at start
    (``registry.deployment.claim``) with its ``TENZRO_DEPLOYMENT``: the first claim on a
    fresh (or pre-existing, unclaimed) database writes the row, a process configured with
    another name is refused. So two unrelated clusters cannot share one PostgreSQL database
    by accident, and every provider, holding and settlement in it belongs to this name.
    """

    id = models.PositiveSmallIntegerField(primary_key=True, default=1)
    name = models.CharField(max_length=64, unique=True)
    created = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return self.name
