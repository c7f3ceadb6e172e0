"""The holder's execution methods over an ``ExpertRuntime``, shared by the site and the agents.

``call(runtime, method, params, fetch)`` runs one of ``tenzro_moeExpertLoad``,
``tenzro_moeGateLoad``, ``tenzro_moeExpertUnload``, ``tenzro_moeGateUnload``,
``tenzro_moeExpertStatus``, ``tenzro_moeRoute``, ``tenzro_moeExecute`` with request and
response fields as the reference (§3, §4.4, §6.1–6.2). The site calls it for its own
runtime (a router may hold experts itself) and each agent for requests the site relays
over its socket. Every failure is a ``moe.jsonrpc.RpcError`` carrying a JSON-RPC code (−32602 bad
params, −32004 execution error) and ``data.field``; the runtime is left unchanged and up.

``fetch(uri) -> bytes`` resolves a ``tenzro://blob/<hash>`` (site: its blob store; agent:
its cache or the site's ``/blobs/``). Pure Python; imports nothing from Django.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from moe import wire
from moe.runtime import ExpertRuntime, RuntimeFault
from moe.jsonrpc import EXECUTION_ERROR, INVALID_PARAMS, METHOD_NOT_FOUND, RpcError

METHODS = ("tenzro_moeExpertLoad", "tenzro_moeGateLoad", "tenzro_moeExpertUnload", "tenzro_moeGateUnload",
           "tenzro_moeExpertStatus", "tenzro_moeRoute", "tenzro_moeExecute")
MANAGEMENT = frozenset({"tenzro_moeExpertLoad", "tenzro_moeGateLoad", "tenzro_moeExpertUnload",
                        "tenzro_moeGateUnload"})
PURPOSES = ("serve", "dispute", "selftest")  # only "serve" is metered

Fetch = Callable[[str], bytes]


def _invalid(message: str, field: str) -> RpcError:
    return RpcError(INVALID_PARAMS, message, field=field)


def _int(p: dict, name: str, lo: int = 0, hi: int = 1 << 31) -> int:
    v = p.get(name)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise _invalid(f"{name} must be an integer in [{lo}, {hi}]", name)
    return v


def _str(p: dict, name: str) -> str:
    v = p.get(name)
    if not isinstance(v, str) or not 0 < len(v) <= 200:
        raise _invalid(f"{name} must be a non-empty string", name)
    return v


def _blob(p: dict, fetch: Fetch) -> tuple[bytes, str | None]:
    uri, b64 = p.get("uri"), p.get("blob_base64")
    if bool(uri) == bool(b64):
        raise _invalid("give exactly one of uri or blob_base64", "uri")
    if b64:
        try:
            return wire.b64decode(b64, "blob_base64"), None
        except wire.WireError as exc:
            raise _invalid(str(exc), "blob_base64") from exc
    if not isinstance(uri, str):
        raise _invalid("uri must be a tenzro://blob/<hash> string", "uri")
    try:
        return fetch(uri), uri
    except Exception as exc:  # fetch failures of any transport: report, never crash the holder
        raise RpcError(EXECUTION_ERROR, f"cannot fetch {uri}: {exc}", field="uri") from exc


def request_rows(p: dict, n_tokens: int, d_model: int) -> np.ndarray:
    """Rows f32 ``[n, d_model]`` of an execute request from ``hidden_states`` (base64 f32 LE)
    or ``hidden_q8`` (base64 Q8_0 blocks, exactly ``n·d_model/32`` of them).

    Raises ``RpcError`` (−32602) naming the field for bad base64, ``d_model`` not divisible
    by 32 with Q8_0, a length that does not match ``n_tokens × d_model``, or non-finite values.
    """
    f32, q8 = p.get("hidden_states"), p.get("hidden_q8")
    if bool(f32) == bool(q8):
        raise _invalid("give exactly one of hidden_states or hidden_q8", "hidden_states")
    if q8 and d_model % 32:
        raise _invalid(f"hidden_q8 needs d_model divisible by 32, got {d_model}", "d_model")
    try:
        if f32:
            return wire.rows_from_b64(f32, d_model, n_tokens)
        return wire.decode_rows(wire.b64decode(q8, "hidden_q8"), "q8_0", d_model, n_tokens, field="hidden_q8")
    except wire.WireError as exc:
        raise RpcError.invalid_params(exc, "hidden_states") from exc


MAX_TOKEN_INDEX = 2**32 - 1  # receipts commit token indices as uint32 (moe.receipts)


def _token_indices(p: dict) -> list[int]:
    t = p.get("token_indices")
    if not isinstance(t, list) or not t or any(isinstance(i, bool) or not isinstance(i, int)
                                               or not 0 <= i <= MAX_TOKEN_INDEX for i in t):
        raise _invalid(f"token_indices must be a non-empty list of integers in [0, {MAX_TOKEN_INDEX}]",
                       "token_indices")
    return t


def execute_key(p: dict) -> tuple[str, int, int, int, list[int]]:
    """``(model_id, layer, expert, d_model, token_indices)`` of an execute request (``tenzro_moeExecute``
    params or an ``execute`` frame header), each checked: model_id a non-empty string, layer and
    expert integers in [0, 2^31], d_model in [1, 2^20], token indices integers in [0, 2^32 - 1].
    Raises ``RpcError`` (-32602) naming the field (a float such as ``1e400`` is not an integer).
    """
    return (_str(p, "model_id"), _int(p, "layer"), _int(p, "expert"), _int(p, "d_model", 1, 1 << 20),
            _token_indices(p))


def _fault(exc: RuntimeFault) -> RpcError:
    return RpcError(EXECUTION_ERROR, str(exc), {"kind": type(exc).__name__}, field=exc.field)


def call(rt: ExpertRuntime, method: str, p: dict, fetch: Fetch) -> dict:
    """Run ``method`` with params ``p`` on ``rt``; returns the JSON-able result.

    Raises ``RpcError`` for an unknown method, bad params, or a runtime fault.
    """
    if not isinstance(p, dict):
        raise _invalid("params must be an object", "params")
    try:
        if method == "tenzro_moeExpertStatus":
            return rt.status()
        if method == "tenzro_moeExpertLoad":
            key = (_str(p, "model_id"), _int(p, "layer"), _int(p, "expert"))
            blob, uri = _blob(p, fetch)
            return rt.load_expert(*key, blob, uri)
        if method == "tenzro_moeGateLoad":
            key = (_str(p, "model_id"), _int(p, "layer"))
            blob, uri = _blob(p, fetch)
            return rt.load_gate(*key, blob, uri)
        if method == "tenzro_moeExpertUnload":
            key = (_str(p, "model_id"), _int(p, "layer"), _int(p, "expert"))
            return {"model_id": key[0], "layer": key[1], "expert": key[2], "unloaded": rt.unload_expert(*key)}
        if method == "tenzro_moeGateUnload":
            key = (_str(p, "model_id"), _int(p, "layer"))
            return {"model_id": key[0], "layer": key[1], "unloaded": rt.unload_gate(*key)}
        if method == "tenzro_moeRoute":
            return _route(rt, p)
        if method == "tenzro_moeExecute":
            return _execute(rt, p)
    except RuntimeFault as exc:
        raise _fault(exc) from exc
    raise RpcError(METHOD_NOT_FOUND, f"method {method!r} not found", field="method")


def _route(rt: ExpertRuntime, p: dict) -> dict:
    model_id, layer, d_model = _str(p, "model_id"), _int(p, "layer"), _int(p, "d_model", 1, 1 << 20)
    top_k = p.get("top_k")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise _invalid("top_k must be a positive integer", "top_k")
    gate = rt.gate(model_id, layer)
    if d_model != gate.d_model:
        raise _invalid(f"d_model is {d_model} but the gate of layer {layer} has d_model "
                          f"{gate.d_model}", "d_model")
    try:
        x = wire.rows_from_b64(p.get("hidden_states"), d_model)
    except wire.WireError as exc:
        raise _invalid(str(exc), "hidden_states") from exc
    if x.shape[0] == 0:
        raise _invalid("hidden_states holds no rows", "hidden_states")
    try:
        r = rt.route(model_id, layer, x, top_k)
    except RuntimeFault:
        raise
    except ValueError as exc:  # top_k outside the gate's range
        raise RpcError.invalid_params(exc, "top_k") from exc
    # Readahead: the experts this routing selected that sit in this holder's disk tier.
    promoted = rt.readahead(model_id, ((layer, int(e)) for e in np.unique(r.expert_ids)))
    return {"model_id": model_id, "layer": layer, "top_k": r.top_k, "tokens": int(x.shape[0]),
            "readahead": promoted,
            "routed": r.routed(layer)}


def _execute(rt: ExpertRuntime, p: dict) -> dict:
    model_id, layer, expert, d_model, tokens = execute_key(p)
    purpose = p.get("purpose", "serve")
    if purpose not in PURPOSES:
        raise _invalid(f"purpose must be one of {', '.join(PURPOSES)}", "purpose")
    if not rt.has(model_id, layer, expert):
        raise RpcError(EXECUTION_ERROR, f"expert {model_id} l{layer}/e{expert} is not loaded on this holder",
                       {"kind": "ExpertNotLoaded"}, field="expert")
    rows = request_rows(p, len(tokens), d_model)
    out = rt.execute(model_id, layer, expert, rows, len(tokens), d_model=d_model, metered=purpose == "serve")
    return execute_result(model_id, layer, expert, tokens, d_model, out)


def execute_result(model_id: str, layer: int, expert: int, tokens: list[int], d_model: int,
                   out: np.ndarray) -> dict:
    """The ``tenzro_moeExecute`` result: the request's key, ``token_indices``, ``d_model`` and
    ``outputs`` (base64 f32 LE of ``out`` f32 ``[n, d_model]``)."""
    return {"model_id": model_id, "layer": layer, "expert": expert, "token_indices": tokens, "d_model": d_model,
            "outputs": wire.rows_to_b64(out)}
