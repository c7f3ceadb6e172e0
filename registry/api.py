"""Registry bindings: JSON-RPC methods and the REST heartbeat endpoint (thin; services do the work)."""
from __future__ import annotations

from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from holders.identity import SignatureError
from registry import selectors, services
from registry.heartbeat import HeartbeatError
from registry.planner import PlanningError, TokenRouting, plan_dispatch
from registry.shardmap import ReplicationPolicy
from tenzro_site.rpc import PLANNING_ERROR, RpcError, rpc_method


class ModelParams(serializers.Serializer):
    """``{model_id}``."""

    model_id = serializers.CharField(max_length=200)


@rpc_method("tenzro_moeShardMap", params=ModelParams)
def shard_map(p: dict) -> dict:
    """The live shard map of a model (holders per expert, replication, coverage)."""
    return selectors.shard_view(p["model_id"]).to_json()


@rpc_method("tenzro_moeReplicationPolicy")
def replication_policy(p: dict) -> dict:
    """The replication policy in force."""
    pol = ReplicationPolicy()
    return {f: getattr(pol, f) for f in pol.__dataclass_fields__}


class ExpertRef(serializers.Serializer):
    """``{layer, expert}``."""

    layer = serializers.IntegerField(min_value=0)
    expert = serializers.IntegerField(min_value=0)


class RoutingParams(serializers.Serializer):
    """One token's routing ``{token_index, experts: [{layer, expert}]}``."""

    token_index = serializers.IntegerField(min_value=0)
    experts = ExpertRef(many=True, allow_empty=False)


class PlanParams(serializers.Serializer):
    """Params of ``tenzro_moePlanDispatch``."""

    model_id = serializers.CharField(max_length=200)
    routings = RoutingParams(many=True, allow_empty=False)
    allow_cold = serializers.BooleanField(required=False, default=False)


@rpc_method("tenzro_moePlanDispatch", params=PlanParams)
def plan(p: dict) -> dict:
    """Plan per-holder batches for the given routings over the live shard view."""
    routings = [TokenRouting(r["token_index"], tuple((e["layer"], e["expert"]) for e in r["experts"]))
                for r in p["routings"]]
    try:
        return plan_dispatch(selectors.shard_view(p["model_id"]), routings, allow_cold=p["allow_cold"]).to_json()
    except PlanningError as exc:
        raise RpcError(PLANNING_ERROR, str(exc), {"field": "routings"}) from exc


class PlaceParams(serializers.Serializer):
    """Params of ``tenzro_moePlaceModel``."""

    model_id = serializers.CharField(max_length=200)
    replication = serializers.IntegerField(min_value=1, max_value=64, required=False, default=2)


@rpc_method("tenzro_moePlaceModel", params=PlaceParams, operator=True)
async def place_model(p: dict) -> dict:
    """Have live agents pull a published model's experts, each on its top providers by rendezvous hashing."""
    try:
        return await services.place_model(p["model_id"], p["replication"])
    except services.PlacementError as exc:
        raise RpcError(PLANNING_ERROR, str(exc), {"field": "model_id"}) from exc


class HeartbeatView(APIView):
    """``POST /api/v1/providers/heartbeat``: a signed heartbeat ``{body, signature}``."""

    def post(self, request):
        """Apply the heartbeat; 400 with a message naming the field when refused."""
        try:
            provider = services.ingest_heartbeat(request.data)
        except HeartbeatError as exc:
            return Response({"error": str(exc), "field": exc.field}, status=400)
        except SignatureError as exc:
            return Response({"error": str(exc), "field": "signature"}, status=400)
        return Response({"provider": provider.provider, "holdings": provider.holdings.count(),
                         "last_heartbeat_ms": provider.last_heartbeat_ms})


__all__ = ["HeartbeatView"]
