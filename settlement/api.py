"""Receipts economy bindings: JSON-RPC methods and their REST mirror (thin; services do the work).

RPC: ``tenzro_moeListReceipts``, ``tenzro_moeGetReceipt``, ``tenzro_moeDisputeReceipt``
(operator), ``tenzro_moeListDisputes``, ``tenzro_moeListSettlements``. REST under
``/api/v1/``: ``receipts``, ``receipts/<key>``, ``receipts/<key>/dispute`` (POST, operator),
``disputes``, ``settlements``. Errors: unknown key → -32004 / 404; no executor → -32004 / 409;
a stored receipt that does not verify → -32004 / 409; bad params → -32602 / 400.
"""
from __future__ import annotations

from asgiref.sync import async_to_sync
from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.response import Response

from registry.api import ERROR, JSON_OBJECT, OPERATOR_AUTH, ApiView
from moe.jsonrpc import RpcError
from registry.operator import is_operator
from registry.rpc import MethodTable
from settlement import selectors, services
from settlement.services import EconomyError

rpc_methods = MethodTable()

PROVIDER = r"^[0-9a-f]{64}$"


class ReceiptQuery(serializers.Serializer):
    """Filters of ``tenzro_moeListReceipts``; ``before``: a key, for the page older than it."""

    model_id = serializers.CharField(max_length=200, required=False)
    provider = serializers.RegexField(PROVIDER, max_length=64, required=False)
    layer = serializers.IntegerField(min_value=0, max_value=100_000, required=False)
    expert = serializers.IntegerField(min_value=0, max_value=1_000_000, required=False)
    limit = serializers.IntegerField(min_value=1, max_value=1000, required=False, default=100)
    before = serializers.CharField(max_length=300, required=False)


class ReceiptKey(serializers.Serializer):
    """``{key}`` of a kept receipt."""

    key = serializers.CharField(max_length=300)


class DisputeQuery(serializers.Serializer):
    """Filters of ``tenzro_moeListDisputes``."""

    provider = serializers.RegexField(PROVIDER, max_length=64, required=False)
    upheld = serializers.BooleanField(required=False, allow_null=True, default=None)
    limit = serializers.IntegerField(min_value=1, max_value=1000, required=False, default=100)


class SettlementQuery(serializers.Serializer):
    """Filters of ``tenzro_moeListSettlements``."""

    model_id = serializers.CharField(max_length=200, required=False)
    provider = serializers.RegexField(PROVIDER, max_length=64, required=False)
    forward_id = serializers.CharField(max_length=64, required=False)
    limit = serializers.IntegerField(min_value=1, max_value=1000, required=False, default=100)


def _rpc(fn, *args, **kw):
    try:
        return fn(*args, **kw)
    except EconomyError as exc:
        raise RpcError(exc.code, exc.message, exc.data) from exc


@rpc_methods.method("tenzro_moeListReceipts", params=ReceiptQuery)
def list_receipts(p: dict) -> dict:
    """Kept (sampled) receipts, newest first."""
    return _rpc(selectors.list_receipts, **p)


@rpc_methods.method("tenzro_moeGetReceipt", params=ReceiptKey)
def get_receipt(p: dict) -> dict:
    """One kept receipt with its header, signed receipt and commitment rows."""
    return _rpc(selectors.get_receipt, p["key"])


@rpc_methods.method("tenzro_moeDisputeReceipt", params=ReceiptKey, operator=True)
async def dispute_receipt(p: dict) -> dict:
    """Re-execute a kept batch on another copy of its blob and judge the holder (operator)."""
    try:
        return await services.dispute(p["key"])
    except EconomyError as exc:
        raise RpcError(exc.code, exc.message, exc.data) from exc


@rpc_methods.method("tenzro_moeListDisputes", params=DisputeQuery)
def list_disputes(p: dict) -> dict:
    """Dispute outcomes with their fraud proofs, newest first."""
    return _rpc(selectors.list_disputes, **p)


@rpc_methods.method("tenzro_moeListSettlements", params=SettlementQuery)
def list_settlements(p: dict) -> dict:
    """Settled forwards per holder, newest first."""
    return _rpc(selectors.list_settlements, **p)


# --------------------------------------------------------------------------- REST mirror


class EconomyView(ApiView):
    """REST base: ``EconomyError`` → 404 for an unknown key, 409 for a refused dispute, 400 otherwise."""

    def run(self, func, params: dict, **kw) -> Response:
        """Call the operation, mapping its errors to HTTP statuses."""
        try:
            return Response(func(**params, **kw))
        except EconomyError as exc:
            status = 404 if exc.message.startswith("no kept receipt") else 409 if exc.code == -32004 else 400
            return Response({"error": exc.message, "field": exc.data.get("field")}, status=status)


class ReceiptsView(EconomyView):
    """``GET /api/v1/receipts``."""

    query = ReceiptQuery

    @extend_schema(operation_id="receipts_list", parameters=[ReceiptQuery], responses={200: JSON_OBJECT, 400: ERROR})
    def get(self, request):
        """Kept receipts, newest first."""
        return self.run(selectors.list_receipts, self.params(request))


class ReceiptView(EconomyView):
    """``GET /api/v1/receipts/<key>``."""

    query = ReceiptKey

    @extend_schema(responses={200: JSON_OBJECT, 400: ERROR, 404: ERROR})
    def get(self, request, key: str):
        """One kept receipt."""
        return self.run(selectors.get_receipt, self.params(request, key=key))


class DisputeView(EconomyView):
    """``POST /api/v1/receipts/<key>/dispute`` (operator credential)."""

    body = ReceiptKey

    @extend_schema(request=None, responses={200: JSON_OBJECT, 403: ERROR, 404: ERROR, 409: ERROR}, auth=OPERATOR_AUTH)
    def post(self, request, key: str):
        """Dispute a kept receipt."""
        if not is_operator(request.headers.get("Authorization")):
            return Response({"error": "disputes need the operator credential: Authorization: Bearer <token>",
                             "field": "Authorization"}, status=403)
        params = self.params(request, from_body=False, key=key)
        return self.run(lambda key: async_to_sync(services.dispute)(key), params)


class DisputesView(EconomyView):
    """``GET /api/v1/disputes``."""

    query = DisputeQuery

    @extend_schema(operation_id="disputes_list", parameters=[DisputeQuery], responses={200: JSON_OBJECT, 400: ERROR})
    def get(self, request):
        """Dispute outcomes, newest first."""
        return self.run(selectors.list_disputes, self.params(request))


class SettlementsView(EconomyView):
    """``GET /api/v1/settlements``."""

    query = SettlementQuery

    @extend_schema(operation_id="settlements_list", parameters=[SettlementQuery],
                   responses={200: JSON_OBJECT, 400: ERROR})
    def get(self, request):
        """Settlements, newest first."""
        return self.run(selectors.list_settlements, self.params(request))
