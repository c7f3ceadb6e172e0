"""JSON-RPC bindings of the router: thin validation around ``router.services``."""
from __future__ import annotations

from rest_framework import serializers

from moe import methods, wire

from router import services
from router.apps import current
from router.forward import ForwardError, ForwardResult
from router.generate import MAX_STOPS
from router.state import UnknownModel
from router.ws import AgentUnavailable
from moe.runtime import GateNotLoaded
from moe.jsonrpc import EXECUTION_ERROR, INVALID_PARAMS, PLANNING_ERROR, RpcError
from registry.services import PlacementError
from registry.rpc import MethodTable


rpc_methods = MethodTable()


class Base64Field(serializers.Field):
    """A base64 string, kept as is (decoded by the service). Unlike ``CharField`` it skips the
    per-character surrogate scan, which cost tens of ms on a forward's hidden states."""

    default_error_messages = {"invalid": "must be a base64 string"}

    def to_internal_value(self, data):
        """Return ``data`` unchanged; reject non-strings."""
        if not isinstance(data, str):
            self.fail("invalid")
        return data

    def to_representation(self, value):
        """The string itself."""
        return value


class PlaceParams(serializers.Serializer):
    """Params of ``tenzro_moePlaceModel``."""

    model_id = serializers.CharField(max_length=200)
    replication = serializers.IntegerField(min_value=1, max_value=64, required=False, default=2)


class ForwardParams(serializers.Serializer):
    """Params of ``tenzro_moeForward`` (docs/DESIGN.md §6)."""

    model_id = serializers.CharField(max_length=200)
    layer = serializers.IntegerField(min_value=0)
    d_model = serializers.IntegerField(min_value=1, max_value=1 << 20)
    hidden_states = Base64Field(help_text="base64 of little-endian f32 [T, d_model]")
    top_k = serializers.IntegerField(min_value=1, required=False, allow_null=True, default=None)
    allow_cold = serializers.BooleanField(required=False, default=False)
    allow_partial = serializers.BooleanField(required=False, default=False)
    carrier = serializers.ChoiceField(list(wire.CARRIER_CHOICES), required=False, default="auto")


def _hidden_rows(p: dict):
    """Decode ``hidden_states`` (base64 f32) into ``[T, d_model]``; raises ``RpcError(-32602)``."""
    try:
        x = wire.rows_from_b64(p["hidden_states"], p["d_model"])
    except wire.WireError as exc:
        raise RpcError(INVALID_PARAMS, str(exc), field="hidden_states") from exc
    if x.shape[0] == 0:
        raise RpcError(INVALID_PARAMS, "hidden_states holds no rows", field="hidden_states")
    return x


async def _forward_errors(p: dict, call) -> dict:
    """Await a forward service call, mapping its errors to JSON-RPC errors that name the field."""
    try:
        return await call
    except UnknownModel as exc:
        raise RpcError(INVALID_PARAMS, str(exc), {"model_id": p["model_id"]}, field="model_id") from exc
    except GateNotLoaded as exc:  # the model is published, this layer is not one of its MoE layers
        raise RpcError(INVALID_PARAMS, str(exc), {"model_id": p["model_id"], "layer": p["layer"]},
                       field="layer") from exc
    except ForwardError as exc:
        code = PLANNING_ERROR if exc.kind == "planning" else EXECUTION_ERROR
        raise RpcError(code, exc.message, exc.data, field="hidden_states") from exc
    except ValueError as exc:  # input that does not fit the gate: a ParamError names d_model, top_k or carrier
        raise RpcError.invalid_params(exc, "hidden_states") from exc


def _common_json(res: ForwardResult) -> dict:
    """The result fields both forward methods share; ``outputs`` base64 f32 [T, d_model] (the JSON edge)."""
    return {"batches": res.batches, "replans": res.replans, "transports": res.transports, "holders": res.holders,
            "failures": res.failures, "receipts": len(res.receipts), "timings_ms": res.timings_ms,
            "forward_id": res.forward_id, "outputs": wire.rows_to_b64(res.output)}


@rpc_methods.method("tenzro_moeForward", params=ForwardParams, forward=True)
async def moe_forward(p: dict) -> dict:
    """Distributed forward of one MoE layer: gate here, experts on holders, gate-weighted combine.

    The reference's result fields plus ``holders``, ``failures``, ``wire`` (bytes each way,
    per element), ``receipts`` (verified count) and ``timings_ms``."""
    x = _hidden_rows(p)
    res = await _forward_errors(p, current().forward(p["model_id"], p["layer"], x, top_k=p["top_k"],
                                                     allow_cold=p["allow_cold"], allow_partial=p["allow_partial"],
                                                     carrier=p["carrier"]))
    r, layer, d_model = res.routing, p["layer"], p["d_model"]
    return {"model_id": p["model_id"], "layer": layer, "d_model": d_model, "top_k": r.top_k,
            "tokens": int(x.shape[0]), "missing": res.missing, "routed": r.routed(layer),
            "wire": {"bytes_out": res.bytes_out, "bytes_back": res.bytes_back,
                     "routed_elements": int(sum(len(toks) for toks in r.tokens_by_expert().values())) * d_model,
                     "input_elements": int(x.shape[0]) * d_model},
            **_common_json(res)}


# ---- execution methods: the site's own runtime, or an agent's when ``provider`` is given ----

class ProviderParam(serializers.Serializer):
    """Optional ``provider``: relay the call to that provider's agent (64 lowercase hex)."""

    provider = serializers.RegexField(r"^[0-9a-f]{64}$", required=False,
                                      help_text="run on this provider's agent instead of the site's runtime")


class StatusParams(ProviderParam):
    """Params of ``tenzro_moeExpertStatus``."""


class GateKeyParams(ProviderParam):
    """``{model_id, layer}``."""

    model_id = serializers.CharField(max_length=200)
    layer = serializers.IntegerField(min_value=0, max_value=100_000)


class ExpertKeyParams(GateKeyParams):
    """``{model_id, layer, expert}``."""

    expert = serializers.IntegerField(min_value=0, max_value=1_000_000)


class BlobSource(serializers.Serializer):
    """Exactly one of ``uri`` (``tenzro://blob/<hash>``) or ``blob_base64``."""

    uri = serializers.CharField(max_length=300, required=False)
    blob_base64 = serializers.CharField(required=False, trim_whitespace=False)

    def validate(self, attrs):
        """Require exactly one blob source."""
        if bool(attrs.get("uri")) == bool(attrs.get("blob_base64")):
            raise serializers.ValidationError({"uri": "give exactly one of uri or blob_base64"})
        return attrs


class ExpertLoadParams(ExpertKeyParams, BlobSource):
    """Params of ``tenzro_moeExpertLoad``."""


class GateLoadParams(GateKeyParams, BlobSource):
    """Params of ``tenzro_moeGateLoad``."""


class RouteParams(GateKeyParams):
    """Params of ``tenzro_moeRoute``."""

    d_model = serializers.IntegerField(min_value=1, max_value=1 << 20)
    hidden_states = serializers.CharField(trim_whitespace=False, help_text="base64 of little-endian f32 [T, d_model]")
    top_k = serializers.IntegerField(min_value=1, required=False, allow_null=True)


class IntListField(serializers.ListField):
    """A ``ListField`` of an ``IntegerField`` child that passes plain in-range integers
    through in one loop and runs the child's validation only on the other items (the first
    one it refuses is named, ``<field>.<index>``). DRF's own ran every item through the
    child's validators: 3 million ``token_indices`` of an anonymous ``tenzro_moeExecute`` held
    the event loop 5 s."""

    def run_child_validation(self, data):
        """The items, validated; raises ``ValidationError`` ``{index: errors}`` at the first bad one."""
        lo, hi = self.child.min_value, self.child.max_value
        out = []
        for i, item in enumerate(data):
            if type(item) is int and (lo is None or item >= lo) and (hi is None or item <= hi):
                out.append(item)
                continue
            try:
                out.append(self.child.run_validation(item))
            except serializers.ValidationError as exc:
                raise serializers.ValidationError({i: exc.detail}) from None
        return out


class ExecuteParams(ExpertKeyParams):
    """Params of ``tenzro_moeExecute`` (reference §6.1)."""

    # uint32 like the holder's receipts: a relayed request is refused here, not by the agent as -32004.
    token_indices = IntListField(
        child=serializers.IntegerField(min_value=0, max_value=methods.MAX_TOKEN_INDEX), allow_empty=False)
    d_model = serializers.IntegerField(min_value=1, max_value=1 << 20)
    hidden_states = serializers.CharField(required=False, trim_whitespace=False)
    hidden_q8 = serializers.CharField(required=False, trim_whitespace=False)
    purpose = serializers.ChoiceField(["serve", "dispute", "selftest"], required=False, default="serve")

    def validate(self, attrs):
        """Require exactly one carrier."""
        if bool(attrs.get("hidden_states")) == bool(attrs.get("hidden_q8")):
            raise serializers.ValidationError({"hidden_states": "give exactly one of hidden_states or hidden_q8"})
        return attrs


def _bind(name: str, params, operator: bool):
    async def method(p: dict) -> dict:
        provider = p.pop("provider", None)
        return await services.call_method(name, {k: v for k, v in p.items() if v is not None}, provider)

    method.__name__ = name
    method.__doc__ = f"``{name}`` on the site's runtime, or relayed to ``provider``'s agent."
    rpc_methods.method(name, params=params, operator=operator, forward=name == "tenzro_moeExecute")(method)
    return method


for _name, _params in (("tenzro_moeExpertLoad", ExpertLoadParams), ("tenzro_moeGateLoad", GateLoadParams),
                       ("tenzro_moeExpertUnload", ExpertKeyParams), ("tenzro_moeGateUnload", GateKeyParams),
                       ("tenzro_moeExpertStatus", StatusParams), ("tenzro_moeRoute", RouteParams),
                       ("tenzro_moeExecute", ExecuteParams)):
    _bind(_name, _params, operator=_name in methods.MANAGEMENT)


class DenseForwardParams(serializers.Serializer):
    """Params of ``tenzro_moeDenseForward``: a dense MLP layer split over holders."""

    model_id = serializers.CharField(max_length=200)
    layer = serializers.IntegerField(min_value=0)
    d_model = serializers.IntegerField(min_value=1, max_value=1 << 20)
    hidden_states = Base64Field(help_text="base64 of little-endian f32 [T, d_model]")
    carrier = serializers.ChoiceField(list(wire.CARRIER_CHOICES), required=False, default="auto")


@rpc_methods.method("tenzro_moeDenseForward", params=DenseForwardParams, forward=True)
async def moe_dense_forward(p: dict) -> dict:
    """Distributed forward of a dense MLP layer split by intermediate slices across holders:
    ``{model_id, layer, d_model, tokens, parts, batches, replans, transports, holders,
    failures, receipts, wire, timings_ms, forward_id, outputs}``."""
    x = _hidden_rows(p)
    res = await _forward_errors(p, current().dense_forward(p["model_id"], p["layer"], x, carrier=p["carrier"]))
    parts, tokens = int(res.routing.expert_ids.shape[1]), int(x.shape[0])
    return {"model_id": p["model_id"], "layer": p["layer"], "d_model": p["d_model"], "tokens": tokens,
            "parts": parts, "wire": {"bytes_out": res.bytes_out, "bytes_back": res.bytes_back,
                                     "routed_elements": tokens * parts * p["d_model"]},
            **_common_json(res)}
@rpc_methods.method("tenzro_moePlaceModel", params=PlaceParams, operator=True)
async def place_model(p: dict) -> dict:
    """Have live agents pull a published model's experts, each on its top providers by rendezvous hashing."""
    try:
        return await services.place_model(p["model_id"], p["replication"])
    except PlacementError as exc:  # -32602 for a model that cannot be placed, -32000 for no live agents
        code = INVALID_PARAMS if exc.field else PLANNING_ERROR
        raise RpcError(code, str(exc), field=exc.field or "model_id") from exc




class BoundedListField(IntListField):
    """A ``ListField`` that refuses more than ``max_length`` items before it validates any
    (DRF's own checks the length only after validating every item: 3 million ``stop`` ids
    held the event loop 3.5 s to be told "at most 64")."""

    default_error_messages = {"max_length": "{length} items; at most {max_length}"}

    def to_internal_value(self, data):
        """Refuse an over-long list at once, else validate as ``ListField`` does."""
        if self.max_length is not None and isinstance(data, list) and len(data) > self.max_length:
            self.fail("max_length", max_length=self.max_length, length=len(data))
        return super().to_internal_value(data)


class IdsOrTextField(serializers.Field):
    """``input_ids``/``prompt``: token ids, a list of id lists (a batch), text, or a list of texts."""

    default_error_messages = {"invalid": "must be a list of token ids, a list of such lists, or text"}

    def to_internal_value(self, data):
        """Keep the value; its shape is checked by ``router.generate.encode_prompts``."""
        if not isinstance(data, (list, str)) or not data:
            self.fail("invalid")
        return data

    def to_representation(self, value):
        """The value itself."""
        return value


class GenerateParams(serializers.Serializer):
    """Params of ``tenzro_moeGenerate``: exactly one of ``input_ids`` or ``prompt``."""

    model_id = serializers.CharField(max_length=200)
    input_ids = IdsOrTextField(required=False)
    prompt = IdsOrTextField(required=False)
    max_new_tokens = serializers.IntegerField(min_value=1, required=False, default=16,
                                              help_text="its upper limit: router.generate.new_token_limit")
    temperature = serializers.FloatField(min_value=0.0, max_value=100.0, required=False, default=0.0)
    top_p = serializers.FloatField(required=False, default=1.0, help_text="in (0, 1]")
    top_k = serializers.IntegerField(min_value=0, required=False, default=0)
    seed = serializers.IntegerField(min_value=0, required=False, allow_null=True, default=None)
    stop = BoundedListField(child=serializers.IntegerField(min_value=0), required=False, default=list,
                            max_length=MAX_STOPS, error_messages={"max_length": "{length} stops; at most {max_length}"})
    carrier = serializers.ChoiceField(list(wire.CARRIER_CHOICES), required=False, default="auto")
    return_logits = serializers.BooleanField(required=False, default=False)
    fallback = serializers.BooleanField(required=False, default=True,
                                        help_text="the site runs batches every remote holder failed")
    handoff = serializers.BooleanField(required=False, default=False,
                                       help_text="prefill on a Prefill agent, KV cache handed to a Decode agent "
                                                 "over the agent socket, decode there (result has kv_handoff)")

    def validate(self, attrs):
        """Require exactly one prompt source; ``handoff`` returns no logits."""
        if ("input_ids" in attrs) == ("prompt" in attrs):
            raise serializers.ValidationError({"input_ids": "give exactly one of input_ids or prompt"})
        if attrs.get("handoff") and attrs.get("return_logits"):
            raise serializers.ValidationError({"return_logits": "return_logits is not available with handoff"})
        return attrs


def sampling_from(p: dict):
    """``Sampling`` from validated params; raises ``RpcError(-32602)`` naming the field."""
    from moe.backbone import BackboneError
    from moe.backbone.decode import Sampling

    try:
        return Sampling(max_new_tokens=p["max_new_tokens"], temperature=p["temperature"], top_p=p["top_p"],
                        top_k=p["top_k"], seed=p["seed"], stop=tuple(p["stop"]))
    except BackboneError as exc:
        raise RpcError(INVALID_PARAMS, str(exc), {"field": exc.field}) from exc


async def generate_errors(call):
    """Await a generation, mapping its errors to JSON-RPC errors that name the field."""
    from moe.backbone import BackboneError
    from router.generate import NoBackbone

    try:
        return await call
    except NoBackbone as exc:
        raise RpcError(INVALID_PARAMS, str(exc), {"field": "model_id"}) from exc
    except ForwardError as exc:
        code = PLANNING_ERROR if exc.kind == "planning" else EXECUTION_ERROR
        raise RpcError(code, exc.message, {"field": "model_id", **exc.data}) from exc
    except GateNotLoaded as exc:
        raise RpcError(EXECUTION_ERROR, str(exc), {"field": "model_id"}) from exc
    except BackboneError as exc:
        raise RpcError(INVALID_PARAMS, str(exc), {"field": exc.field}) from exc
    except AgentUnavailable as exc:  # a Prefill/Decode agent failed or timed out during a handoff run
        raise RpcError(EXECUTION_ERROR, str(exc), {"field": "handoff"}) from exc


@rpc_methods.method("tenzro_moeGenerate", params=GenerateParams, forward=True)
async def moe_generate(p: dict) -> dict:
    """Generate tokens: backbone on this site, MoE layers on the holders (greedy or sampled)."""
    from router.generate import generate

    sampling = sampling_from(p)
    field = "input_ids" if "input_ids" in p else "prompt"
    prompt = p[field]
    if p["handoff"]:
        from router.disaggregate import generate_handoff

        return await generate_errors(generate_handoff(p["model_id"], prompt, sampling, p["carrier"], field))
    result = await generate_errors(generate(p["model_id"], prompt, sampling, p["carrier"], p["return_logits"],
                                            fallback=p["fallback"], prompt_field=field))
    if "prompt_logits" in result:  # base64 f32 [T, vocab] at the JSON edge only
        result["prompt_logits"] = wire.rows_to_b64(result["prompt_logits"])
    return result
