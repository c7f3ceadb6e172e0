"""Registry bindings: JSON-RPC methods and their REST mirror under ``/api/v1/`` (thin; services do the work).

Every operation is one plain function ``op_*(params) -> JSON`` shared by the RPC method and
the REST view, so both surfaces answer the same shapes. Errors: ``PlanningError`` → RPC
-32000 / HTTP 422; ``GovernanceError`` → -32602 / 400 (404 for an unknown proposal,
409 for a decided one); unknown models → -32602 / 404; signature failures → -32001 / 403.
Management operations (create, withdraw, operator votes, placement) need the operator
credential (docs/DESIGN.md §6): ``Authorization: Bearer <token>``.
"""
from __future__ import annotations

from django.conf import settings
from django.db.models import Count
from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import exceptions, permissions, serializers, throttling
from rest_framework.response import Response
from rest_framework.views import APIView

from moe.identity import SignatureError, loads_signed
from moe.ranges import format_ranges
from registry import catalog, governance, selectors, services
from registry.heartbeat import HeartbeatError
from registry.models import Holding, MoeModel, Provider, Proposal
from registry.planner import PlanningError, TokenRouting, plan_dispatch
from moe.shardmap import ROLES
from registry.operator import is_operator
from moe.jsonrpc import AUTH_REFUSED, INVALID_PARAMS, PLANNING_ERROR, RpcError
from registry.rpc import MethodTable, first_error

# --------------------------------------------------------------------------- serializers


rpc_methods = MethodTable()


class ModelParams(serializers.Serializer):
    """``{model_id}``."""

    model_id = serializers.CharField(max_length=200)


class ExpertRef(serializers.Serializer):
    """``{layer, expert}``."""

    layer = serializers.IntegerField(min_value=0, max_value=100_000)
    expert = serializers.IntegerField(min_value=0, max_value=1_000_000)


class RoutingParams(serializers.Serializer):
    """One token's routing ``{token_index, experts: [{layer, expert}]}``."""

    token_index = serializers.IntegerField(min_value=0, max_value=2**31 - 1)
    experts = ExpertRef(many=True, allow_empty=False, max_length=64)


class PlanParams(serializers.Serializer):
    """Params of ``tenzro_moePlanDispatch``; ``split_threshold`` defaults to ``TENZRO["PLAN_SPLIT_THRESHOLD"]``
    (0 disables splitting)."""

    model_id = serializers.CharField(max_length=200)
    routings = RoutingParams(many=True, allow_empty=False, max_length=65_536)
    allow_cold = serializers.BooleanField(required=False, default=False)
    split_threshold = serializers.IntegerField(required=False, min_value=0, max_value=2**31 - 1)


class ProviderQuery(serializers.Serializer):
    """Filters of the provider list: ``live`` (only live providers), ``role``, ``limit``, ``offset``."""

    live = serializers.BooleanField(required=False, default=False)
    role = serializers.ChoiceField(choices=ROLES, required=False)
    limit = serializers.IntegerField(required=False, default=100, min_value=1, max_value=1000)
    offset = serializers.IntegerField(required=False, default=0, min_value=0, max_value=2**31 - 1)


class ProviderParams(serializers.Serializer):
    """``{provider}``: a 64-hex ed25519 key."""

    provider = serializers.RegexField(r"^[0-9a-f]{64}$", max_length=64)


class HoldingQuery(serializers.Serializer):
    """Filters of the holdings list (``compact`` groups them as expert ranges per model and layer)."""

    provider = serializers.RegexField(r"^[0-9a-f]{64}$", max_length=64, required=False)
    model_id = serializers.CharField(max_length=200, required=False)
    compact = serializers.BooleanField(required=False, default=False)
    limit = serializers.IntegerField(required=False, default=1000, min_value=1, max_value=100_000)
    offset = serializers.IntegerField(required=False, default=0, min_value=0, max_value=2**31 - 1)


class ProposalCreate(serializers.Serializer):
    """A new proposal: ``changes`` maps policy fields to new values."""

    title = serializers.CharField(max_length=200)
    description = serializers.CharField(max_length=10_000, required=False, allow_blank=True, default="")
    changes = serializers.DictField(child=serializers.JSONField(), allow_empty=False)


class ProposalRef(serializers.Serializer):
    """``{proposal_id}``."""

    proposal_id = serializers.IntegerField(min_value=1, max_value=2**31 - 1)


class ProposalQuery(serializers.Serializer):
    """Filters of the proposal list."""

    status = serializers.ChoiceField(choices=Proposal.Status.values, required=False)
    limit = serializers.IntegerField(required=False, default=100, min_value=1, max_value=1000)


class SignedVote(serializers.Serializer):
    """A provider's signed vote ``{body: {provider, proposal_id, approve, timestamp_ms}, signature}``."""

    body = serializers.DictField()
    signature = serializers.CharField(max_length=256)


class VoteParams(serializers.Serializer):
    """``{proposal_id, approve}`` (voter = operator; needs the credential) or ``{vote: SignedVote}``."""

    proposal_id = serializers.IntegerField(min_value=1, max_value=2**31 - 1, required=False)
    approve = serializers.BooleanField(required=False)
    vote = SignedVote(required=False)

    def validate(self, attrs):
        """Exactly one form: a signed provider vote, or ``proposal_id`` + ``approve``."""
        if "vote" in attrs:
            if "approve" in attrs:
                raise serializers.ValidationError({"approve": "give either vote or approve, not both"})
        elif "approve" not in attrs or "proposal_id" not in attrs:
            raise serializers.ValidationError({"approve": "needs proposal_id and approve, or a signed vote"})
        return attrs


class AuditQuery(serializers.Serializer):
    """``{limit}`` of the audit trail."""

    limit = serializers.IntegerField(required=False, default=100, min_value=1, max_value=1000)


# --------------------------------------------------------------------------- operations


class NotFound(LookupError):
    """An id (model, provider, proposal) the site does not know; ``field`` names it."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


def provider_json(p: Provider, holdings: int | None = None) -> dict:
    """A provider record: the reference's ``ProviderInfo`` fields plus liveness, ``state`` (one of
    ``registry.selectors.PROVIDER_STATES``: liveness and faults in one word), the data-plane
    record (``batches_served``, ``batch_failures``, ``last_failure``, ``last_success``) and the
    holding count."""
    cutoff = selectors.live_cutoff()
    return {"provider": p.provider, "name": p.name, "http_endpoint": p.http_endpoint,
            "iroh_endpoint_id": p.iroh_endpoint_id, "iroh_addrs": list(p.iroh_addrs or []), "roles": list(p.roles),
            "moe_gpu": p.moe_gpu,
            "price_per_input_token": p.price_per_input_token, "minimum_price": p.minimum_price,
            "reputation": p.reputation, "status": p.status, "connected": p.connected,
            "live": selectors.is_live(p, cutoff), "state": selectors.provider_state(p, cutoff),
            "last_heartbeat": p.last_heartbeat.isoformat() if p.last_heartbeat else None,
            "last_heartbeat_ms": p.last_heartbeat_ms,
            "batches_served": p.batches_served, "batch_failures": p.batch_failures,
            "last_failure": p.last_failure.isoformat() if p.last_failure else None,
            "last_success": p.last_success.isoformat() if p.last_success else None,
            "holdings": holdings if holdings is not None else p.holdings.count(),
            "balance": p.balance, "quarantined_until_ms": p.quarantined_until_ms}


def op_providers(p: dict) -> dict:
    """``{providers: [...], count}`` ordered by provider id."""
    qs = selectors.live_providers() if p.get("live") else Provider.objects.all()
    rows = list(qs.annotate(n=Count("holdings")))
    if p.get("role"):
        rows = [r for r in rows if p["role"] in r.roles]
    page = rows[p.get("offset", 0):p.get("offset", 0) + p.get("limit", 100)]
    return {"providers": [provider_json(r, r.n) for r in page], "count": len(rows)}


def op_provider(p: dict) -> dict:
    """One provider record; ``NotFound`` when unknown."""
    row = Provider.objects.filter(provider=p["provider"]).first()
    if row is None:
        raise NotFound(f"no provider {p['provider']}", "provider")
    return provider_json(row)


def compact_holdings(rows) -> list[dict]:
    """Group ``(provider, model_id, layer, expert, residency, committed_tps)`` rows (sorted) into the
    heartbeat's compact form: ``{provider, model_id, layer, experts: "lo-hi,...", residency, committed_tps}``."""
    out: list[dict] = []
    last = None
    for prov, model_id, layer, expert, residency, tps in rows:
        key = (prov, model_id, layer, residency, tps)
        if key != last:
            out.append({"provider": prov, "model_id": model_id, "layer": layer, "experts": [],
                        "residency": residency, "committed_tps": tps})
            last = key
        out[-1]["experts"].append(expert)
    for entry in out:
        entry["experts"] = format_ranges(entry["experts"])
    return out


def op_holdings(p: dict) -> dict:
    """``{holdings: [...], count}``: expanded rows, or compact ranges with ``compact``."""
    qs = Holding.objects.all()
    if p.get("provider"):
        qs = qs.filter(provider_id=p["provider"])
    if p.get("model_id"):
        qs = qs.filter(model_id=p["model_id"])
    if p.get("compact"):
        rows = qs.order_by("provider_id", "model_id", "layer", "residency", "committed_tps", "expert")
        groups = compact_holdings(rows.values_list("provider_id", "model_id", "layer", "expert", "residency",
                                                   "committed_tps"))
        start = p.get("offset", 0)
        return {"holdings": groups[start:start + p.get("limit", 1000)], "count": len(groups)}
    start = p.get("offset", 0)
    page = qs.values("provider_id", "model_id", "layer", "expert", "residency", "committed_tps",
                     "blob_uri")[start:start + p.get("limit", 1000)]
    return {"holdings": [{"provider": h.pop("provider_id"), **h} for h in page], "count": qs.count()}


def op_shard_map(p: dict) -> dict:
    """The ``tenzro_moeShardMap`` result (see ``ShardView.to_json``); ``NotFound`` for a model
    neither published here nor declared by any provider (a typo is not an empty map)."""
    model_id = p["model_id"]
    if not (MoeModel.objects.filter(model_id=model_id).exists()
            or Holding.objects.filter(model_id=model_id).exists()):
        raise NotFound(f"unknown model {model_id[:200]!r}: not published here and held by no provider", "model_id")
    return selectors.shard_map_json(model_id)


def op_plan(p: dict) -> dict:
    """The ``tenzro_moePlanDispatch`` result; raises ``PlanningError``."""
    routings = [TokenRouting(r["token_index"], tuple((e["layer"], e["expert"]) for e in r["experts"]))
                for r in p["routings"]]
    split = p.get("split_threshold", settings.TENZRO["PLAN_SPLIT_THRESHOLD"])
    return plan_dispatch(selectors.shard_view(p["model_id"]), routings, allow_cold=p.get("allow_cold", False),
                         split_threshold=split or None).to_json()


def op_policy(p: dict) -> dict:
    """The policy in force (``governance.policy_json``)."""
    return governance.policy_json()


def op_catalog_shape(p: dict) -> dict:
    """The ``tenzro_moeCatalogShape`` result (seed catalog, else a model published here:
    ``selectors.catalog_shape``); ``NotFound`` (with close matches) for an unknown id."""
    try:
        return selectors.catalog_shape(p["model_id"]).catalog_shape()
    except catalog.UnknownModelError as exc:
        raise NotFound(str(exc), "model_id") from exc


def op_catalog(p: dict) -> dict:
    """``{models: [shape, ...], count}``: every catalog entry, then the MoE models published on
    this site that the catalog lacks."""
    models = [m.catalog_shape() for m in catalog.all_models() + selectors.published_shapes()]
    return {"models": models, "count": len(models)}


def _proposal(proposal_id: int) -> Proposal:
    p = Proposal.objects.filter(pk=proposal_id).prefetch_related("votes").first()
    if p is None:
        raise NotFound(f"no proposal with id {proposal_id}", "proposal_id")
    return p


def op_proposals(p: dict) -> dict:
    """``{proposals: [...], count}`` newest first."""
    qs = Proposal.objects.prefetch_related("votes")
    if p.get("status"):
        qs = qs.filter(status=p["status"])
    rows = [governance.proposal_json(x) for x in qs[:p.get("limit", 100)]]
    return {"proposals": rows, "count": len(rows)}


def op_proposal(p: dict) -> dict:
    """One proposal with its votes and tally."""
    return governance.proposal_json(_proposal(p["proposal_id"]))


def op_create_proposal(p: dict) -> dict:
    """Open a proposal as the operator; raises ``GovernanceError``."""
    prop = governance.create_proposal(p["title"], p["changes"], "operator", p.get("description", ""))
    return governance.proposal_json(prop)


def op_vote(p: dict, operator: bool) -> dict:
    """Record a vote: a signed provider vote, or the operator's (needs ``operator``)."""
    if "vote" in p:
        prop = governance.signed_vote({"body": p["vote"]["body"], "signature": p["vote"]["signature"]})
    else:
        if not operator:
            raise PermissionError("an unsigned vote is the operator's and needs the operator credential")
        _proposal(p["proposal_id"])
        prop = governance.vote(p["proposal_id"], "operator", p["approve"])
    return governance.proposal_json(prop)


def op_withdraw(p: dict) -> dict:
    """Withdraw an open proposal as the operator."""
    _proposal(p["proposal_id"])
    return governance.proposal_json(governance.withdraw(p["proposal_id"], "operator"))


def op_audit(p: dict) -> dict:
    """``{entries: [...]}`` newest first."""
    return {"entries": governance.audit_json(p.get("limit", 100))}


# --------------------------------------------------------------------------- JSON-RPC


def _rpc(func, params: dict, operator: bool = False):
    """Run an operation and map its errors to JSON-RPC errors naming the field."""
    try:
        return func(params, operator) if func is op_vote else func(params)
    except PlanningError as exc:
        raise RpcError(PLANNING_ERROR, str(exc), {"field": "routings"}) from exc
    except NotFound as exc:
        raise RpcError(INVALID_PARAMS, str(exc), {"field": exc.field}) from exc
    except governance.GovernanceError as exc:
        raise RpcError(INVALID_PARAMS, str(exc), {"field": exc.field}) from exc
    except SignatureError as exc:
        raise RpcError(AUTH_REFUSED, str(exc), {"field": "vote.signature"}) from exc
    except PermissionError as exc:
        raise RpcError(AUTH_REFUSED, str(exc), {"field": "Authorization"}) from exc


@rpc_methods.method("tenzro_moeShardMap", params=ModelParams)
def shard_map(p: dict) -> dict:
    """The live shard map of a model (holders per expert, replication, coverage)."""
    return _rpc(op_shard_map, p)


@rpc_methods.method("tenzro_moePlanDispatch", params=PlanParams)
def plan(p: dict) -> dict:
    """Plan per-holder batches for the given routings over the live shard view."""
    return _rpc(op_plan, p)


@rpc_methods.method("tenzro_moeReplicationPolicy")
def replication_policy(p: dict) -> dict:
    """The replication policy in force (from the database; changed only by proposals)."""
    return _rpc(op_policy, p)


@rpc_methods.method("tenzro_moeCatalogShape", params=ModelParams)
def catalog_shape(p: dict) -> dict:
    """The seed-catalog shape of a model."""
    return _rpc(op_catalog_shape, p)


@rpc_methods.method("tenzro_moeListProviders", params=ProviderQuery)
def list_providers(p: dict) -> dict:
    """Registered providers (``live`` to keep only live ones)."""
    return _rpc(op_providers, p)


@rpc_methods.method("tenzro_moeListProposals", params=ProposalQuery)
def list_proposals(p: dict) -> dict:
    """Governance proposals, newest first."""
    return _rpc(op_proposals, p)


@rpc_methods.method("tenzro_moeGetProposal", params=ProposalRef)
def get_proposal(p: dict) -> dict:
    """One proposal with votes and tally."""
    return _rpc(op_proposal, p)


@rpc_methods.method("tenzro_moeCreateProposal", params=ProposalCreate, operator=True)
def create_proposal(p: dict) -> dict:
    """Open a policy proposal (operator)."""
    return _rpc(op_create_proposal, p)


@rpc_methods.method("tenzro_moeVoteProposal", params=VoteParams, pass_operator=True)
def vote_proposal(p: dict) -> dict:
    """A provider's signed vote (open), or the operator's vote (checked in ``op_vote``)."""
    return _rpc(op_vote, p, operator=p.pop("_operator"))


@rpc_methods.method("tenzro_moeWithdrawProposal", params=ProposalRef, operator=True)
def withdraw_proposal(p: dict) -> dict:
    """Withdraw an open proposal (operator)."""
    return _rpc(op_withdraw, p)


@rpc_methods.method("tenzro_moeGovernanceAudit", params=AuditQuery)
def governance_audit(p: dict) -> dict:
    """The governance audit trail, newest first."""
    return _rpc(op_audit, p)


# --------------------------------------------------------------------------- REST


class PayloadTooLarge(exceptions.APIException):
    """HTTP 413 with the limit in the message."""

    status_code = 413
    default_code = "payload_too_large"


class Unprocessable(exceptions.APIException):
    """HTTP 422: well-formed input that cannot be planned."""

    status_code = 422
    default_code = "unprocessable"


class Conflict(exceptions.APIException):
    """HTTP 409: the resource is in the wrong state (e.g. a decided proposal)."""

    status_code = 409
    default_code = "conflict"


class IsOperator(permissions.BasePermission):
    """Requires ``Authorization: Bearer <operator token>`` (docs/DESIGN.md §6)."""

    message = "this endpoint needs the operator credential: Authorization: Bearer <token>"

    def has_permission(self, request, view) -> bool:
        """True when the header carries the operator token."""
        return is_operator(request.headers.get("Authorization"))


class ReadThrottle(throttling.AnonRateThrottle):
    """Per-address rate for reads (``TENZRO["API_READ_RATE"]``)."""

    scope = "read"

    def get_rate(self):
        """The configured rate, e.g. ``"600/min"``."""
        return settings.TENZRO["API_READ_RATE"]


class WriteThrottle(throttling.AnonRateThrottle):
    """Per-address rate for writes (``TENZRO["API_WRITE_RATE"]``)."""

    scope = "write"

    def get_rate(self):
        """The configured rate, e.g. ``"120/min"``."""
        return settings.TENZRO["API_WRITE_RATE"]


#: OpenAPI security of endpoints that need the operator token (scheme in SPECTACULAR_SETTINGS), and
#: of those where it is one of two ways in (a vote: the operator, or a provider's signed body).
OPERATOR_AUTH = [{"operatorToken": []}]
OPERATOR_OR_SIGNED_AUTH = [{"operatorToken": []}, {}]

ERROR = inline_serializer("Error", {"error": serializers.CharField(), "field": serializers.CharField(required=False)})
JSON_OBJECT = {"type": "object", "additionalProperties": True}


class ApiView(APIView):
    """Base of the REST mirror: body-size limit (413), throttles by method, errors as ``{error, field}``.

    ``max_body`` (bytes) caps the declared ``Content-Length``; ``op`` is the shared operation;
    ``query`` / ``body`` are the serializers validating the query string / JSON body.
    """

    max_body = 1024 * 1024
    query: type[serializers.Serializer] | None = None
    body: type[serializers.Serializer] | None = None

    def initialize_request(self, request, *args, **kwargs):
        """A chunked body (no ``Content-Length``) gets its length set from the body as read:
        DRF parses a body only when ``Content-Length`` declares one, so a chunked JSON body read
        as empty ("model_id: This field is required"). Reading it here is bounded by the site's
        ``TENZRO_MAX_BODY`` (Django's ``RequestDataTooBig``, a JSON 413), and :meth:`initial`
        then holds it to ``max_body`` like a declared one."""
        if request.method not in ("GET", "HEAD", "OPTIONS") and not request.META.get("CONTENT_LENGTH"):
            request.META["CONTENT_LENGTH"] = str(len(request.body))
        return super().initialize_request(request, *args, **kwargs)

    def get_throttles(self):
        """Reads and writes have separate per-address budgets."""
        return [ReadThrottle() if self.request.method in ("GET", "HEAD", "OPTIONS") else WriteThrottle()]

    def initial(self, request, *args, **kwargs):
        """Refuse an over-limit body before parsing it."""
        try:
            length = int(request.META.get("CONTENT_LENGTH") or 0)
        except ValueError:
            length = 0
        if length > self.max_body:
            raise PayloadTooLarge(f"request body is {length} bytes, over this endpoint's {self.max_body}-byte limit")
        super().initial(request, *args, **kwargs)

    def params(self, request, from_body: bool = True, **extra) -> dict:
        """Validated query (GET) or body (POST, unless not ``from_body``) params merged with URL ``extra``;
        400 naming the field."""
        ser_cls = self.query if request.method == "GET" else self.body
        raw = request.query_params.dict() if request.method == "GET" or not from_body else request.data
        if not isinstance(raw, dict):
            raise _Bad("the request body must be a JSON object", "body")
        data = {**raw, **extra}
        if ser_cls is None:
            return data
        ser = ser_cls(data=data)
        if not ser.is_valid():
            field, msg = first_error(ser.errors)
            raise _Bad(f"{field}: {msg}" if field else msg, field or "body")
        return dict(ser.validated_data)

    def run(self, func, params: dict, **kw) -> Response:
        """Call an operation, mapping its errors to HTTP statuses."""
        try:
            return Response(func(params, **kw))
        except NotFound as exc:
            return Response({"error": str(exc), "field": exc.field}, status=404)
        except PlanningError as exc:
            return Response({"error": str(exc), "field": "routings"}, status=422)
        except governance.GovernanceError as exc:
            decided = exc.field == "proposal_id" and "not Open" in str(exc)
            return Response({"error": str(exc), "field": exc.field}, status=409 if decided else 400)
        except SignatureError as exc:
            return Response({"error": str(exc), "field": "vote.signature"}, status=403)
        except PermissionError as exc:
            return Response({"error": str(exc), "field": "Authorization"}, status=403)


class _Bad(exceptions.APIException):
    """HTTP 400 ``{error, field}``."""

    status_code = 400
    default_code = "invalid"

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


class HeartbeatMessage(serializers.Serializer):
    """A signed heartbeat (schema only; ``registry.heartbeat`` validates the body)."""

    body = serializers.DictField(help_text="signed body: provider, timestamp_ms, nonce, roles, holdings, ...")
    signature = serializers.CharField(help_text="ed25519 signature (hex) over the canonical body")


class HeartbeatView(ApiView):
    """``POST /api/v1/providers/heartbeat``: a signed heartbeat ``{body, signature}`` (8 MiB cap)."""

    max_body = 8 * 1024 * 1024

    @extend_schema(request=HeartbeatMessage, responses={200: JSON_OBJECT, 400: ERROR, 413: ERROR, 429: ERROR},
                   summary="Apply a signed provider heartbeat (expanded or compact holdings)")
    def post(self, request):
        """Apply the heartbeat; 400 with a message naming the field when refused (a repeated JSON
        key included: the body is parsed here, refusing duplicates before the signature is checked)."""
        try:
            message = loads_signed(request.body)
        except SignatureError as exc:
            return Response({"error": str(exc), "field": "body"}, status=400)
        except RecursionError:
            return Response({"error": "JSON parse error - nested too deeply", "field": "body"}, status=400)
        except ValueError as exc:
            return Response({"error": f"JSON parse error - {str(exc)[:200]}", "field": "body"}, status=400)
        if not isinstance(message, dict):
            return Response({"error": "heartbeat must be a JSON object {body, signature}", "field": "body"},
                            status=400)
        try:
            provider = services.ingest_heartbeat(message, client=request.META.get("REMOTE_ADDR") or "?")
        except HeartbeatError as exc:
            return Response({"error": str(exc), "field": exc.field}, status=exc.status)
        except SignatureError as exc:
            return Response({"error": str(exc), "field": "signature"}, status=400)
        return Response({"provider": provider.provider, "holdings": provider.holdings.count(),
                         "last_heartbeat_ms": provider.last_heartbeat_ms})


class ProvidersView(ApiView):
    """``GET /api/v1/providers``."""

    query = ProviderQuery

    @extend_schema(operation_id="providers_list", parameters=[ProviderQuery], responses={200: JSON_OBJECT, 400: ERROR})
    def get(self, request):
        """Registered providers."""
        return self.run(op_providers, self.params(request))


class ProviderView(ApiView):
    """``GET /api/v1/providers/<provider>``."""

    query = ProviderParams

    @extend_schema(responses={200: JSON_OBJECT, 400: ERROR, 404: ERROR})
    def get(self, request, provider: str):
        """One provider."""
        return self.run(op_provider, self.params(request, provider=provider))


class HoldingsView(ApiView):
    """``GET /api/v1/holdings``."""

    query = HoldingQuery

    @extend_schema(parameters=[HoldingQuery], responses={200: JSON_OBJECT, 400: ERROR})
    def get(self, request):
        """Declared holdings, expanded or compact."""
        return self.run(op_holdings, self.params(request))


class ShardMapView(ApiView):
    """``GET /api/v1/shard-map?model_id=``."""

    query = ModelParams

    @extend_schema(parameters=[ModelParams], responses={200: JSON_OBJECT, 400: ERROR})
    def get(self, request):
        """The ``tenzro_moeShardMap`` result."""
        return self.run(op_shard_map, self.params(request))


class PlanView(ApiView):
    """``POST /api/v1/plan``."""

    body = PlanParams
    max_body = 8 * 1024 * 1024

    @extend_schema(request=PlanParams, responses={200: JSON_OBJECT, 400: ERROR, 413: ERROR, 422: ERROR})
    def post(self, request):
        """The ``tenzro_moePlanDispatch`` result."""
        return self.run(op_plan, self.params(request))


class PolicyView(ApiView):
    """``GET /api/v1/policy``."""

    @extend_schema(responses={200: JSON_OBJECT})
    def get(self, request):
        """The policy in force."""
        return self.run(op_policy, {})


class CatalogView(ApiView):
    """``GET /api/v1/catalog``."""

    @extend_schema(operation_id="catalog_list", responses={200: JSON_OBJECT})
    def get(self, request):
        """Every catalog shape."""
        return self.run(op_catalog, {})


class CatalogShapeView(ApiView):
    """``GET /api/v1/catalog/<model_id>``."""

    query = ModelParams

    @extend_schema(responses={200: JSON_OBJECT, 400: ERROR, 404: ERROR})
    def get(self, request, model_id: str):
        """The ``tenzro_moeCatalogShape`` result."""
        return self.run(op_catalog_shape, self.params(request, model_id=model_id))


class ProposalsView(ApiView):
    """``GET /api/v1/proposals``; ``POST`` (operator) opens one."""

    query = ProposalQuery
    body = ProposalCreate

    def get_permissions(self):
        """Creating needs the operator credential."""
        return [IsOperator()] if self.request.method == "POST" else []

    @extend_schema(operation_id="proposals_list", parameters=[ProposalQuery], responses={200: JSON_OBJECT, 400: ERROR})
    def get(self, request):
        """Proposals, newest first."""
        return self.run(op_proposals, self.params(request))

    @extend_schema(request=ProposalCreate, responses={200: JSON_OBJECT, 400: ERROR, 403: ERROR}, auth=OPERATOR_AUTH)
    def post(self, request):
        """Open a proposal."""
        return self.run(op_create_proposal, self.params(request))


class ProposalView(ApiView):
    """``GET /api/v1/proposals/<id>``."""

    query = ProposalRef

    @extend_schema(responses={200: JSON_OBJECT, 400: ERROR, 404: ERROR})
    def get(self, request, proposal_id: int):
        """One proposal with votes and tally."""
        return self.run(op_proposal, self.params(request, proposal_id=proposal_id))


class VoteView(ApiView):
    """``POST /api/v1/proposals/<id>/vote``: ``{approve}`` (operator) or ``{vote: signed}`` (provider)."""

    body = VoteParams

    @extend_schema(request=VoteParams, responses={200: JSON_OBJECT, 400: ERROR, 403: ERROR, 404: ERROR,
                                                  409: ERROR}, auth=OPERATOR_OR_SIGNED_AUTH)
    def post(self, request, proposal_id: int):
        """Vote; the signed body's proposal_id must match the URL."""
        p = self.params(request, proposal_id=proposal_id)
        if "vote" in p and p["vote"]["body"].get("proposal_id") != proposal_id:
            return Response({"error": "vote.body.proposal_id differs from the URL", "field": "vote.body.proposal_id"},
                            status=400)
        return self.run(op_vote, p, operator=is_operator(request.headers.get("Authorization")))


class WithdrawView(ApiView):
    """``POST /api/v1/proposals/<id>/withdraw`` (operator)."""

    body = ProposalRef
    permission_classes = [IsOperator]

    @extend_schema(request=None, responses={200: JSON_OBJECT, 403: ERROR, 404: ERROR, 409: ERROR}, auth=OPERATOR_AUTH)
    def post(self, request, proposal_id: int):
        """Withdraw an open proposal."""
        return self.run(op_withdraw, self.params(request, from_body=False, proposal_id=proposal_id))


class AuditView(ApiView):
    """``GET /api/v1/governance/audit``."""

    query = AuditQuery

    @extend_schema(parameters=[AuditQuery], responses={200: JSON_OBJECT, 400: ERROR})
    def get(self, request):
        """The audit trail, newest first."""
        return self.run(op_audit, self.params(request))


__all__ = ["AuditView", "CatalogShapeView", "CatalogView", "HeartbeatView", "HoldingsView", "PlanView",
           "PolicyView", "ProposalView", "ProposalsView", "ProviderView", "ProvidersView", "ShardMapView",
           "VoteView", "WithdrawView", "compact_holdings", "provider_json"]


# --------------------------------------------------------------------------- repair passes


class RepairStatusParams(serializers.Serializer):
    """``{model_id?, limit?}`` of ``tenzro_moeRepairStatus``."""

    model_id = serializers.CharField(max_length=200, required=False)
    limit = serializers.IntegerField(min_value=1, max_value=500, required=False, default=20)


@rpc_methods.method("tenzro_moeRepairStatus", params=RepairStatusParams)
def repair_status(p: dict) -> dict:
    """Recorded repair passes, newest first: period, plan rows, accepted, declined with reason,
    released, fetched bytes, duration (``registry.repair_service.repair_status``)."""
    from registry import repair_service

    return repair_service.repair_status(p.get("model_id"), p["limit"])


# --------------------------------------------------------------------------- expert-coverage market


class MarketModelParams(serializers.Serializer):
    """``{model_id, name?, n_embd?, n_layer?, n_expert?, expert_layers?}`` of ``tenzro_moeMarketAddModel``:
    the shape fields are taken from the publication of a model published here, and are required
    for one that is not (``registry.market.add_model``)."""

    model_id = serializers.CharField(max_length=200)
    name = serializers.CharField(max_length=200, required=False, default="", allow_blank=True)
    n_embd = serializers.IntegerField(min_value=1, max_value=1 << 20, required=False)
    n_layer = serializers.IntegerField(min_value=1, max_value=10_000, required=False)
    n_expert = serializers.IntegerField(min_value=1, max_value=1 << 16, required=False)
    expert_layers = serializers.ListField(child=serializers.IntegerField(min_value=0, max_value=10_000),
                                          allow_empty=False, max_length=10_000, required=False)


@rpc_methods.method("tenzro_moeMarketAddModel", params=MarketModelParams, operator=True)
def market_add_model(p: dict) -> dict:
    """List a model on the expert-coverage market (``registry.market.add_model``): a model published
    here takes its shape (MoE layers, expert count, hidden size, block count) from the publication."""
    from registry import market

    try:
        return market.add_model(p["model_id"], p.get("n_embd"), p.get("n_layer"), p.get("n_expert"),
                                p.get("expert_layers"), p.get("name", ""))
    except ValueError as exc:
        field, message = exc.args
        raise RpcError(INVALID_PARAMS, message, {"field": field}) from exc
