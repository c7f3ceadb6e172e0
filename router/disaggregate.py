"""Disaggregated generation on the site: prefill on an agent with role ``Prefill``, the KV
cache handed to an agent with role ``Decode``, decode there (``moe.handoff`` is the agent
side); both agents run the backbone and call the site's distributed forward for every MLP
layer.

The handoff goes peer to peer when the Decode agent advertises an endpoint (issue 22): the
site sends the Prefill agent ``kv_send`` with the Decode agent's iroh and HTTP endpoints and
the Prefill agent sends the cache there itself (iroh, HTTP fallback; signed chunks). When the
Decode agent advertises none, when ``TENZRO_KV_HANDOFF`` is ``site``, or when the peer send
fails, the site relays it through the agent sockets (``kv_get`` from the Prefill agent,
``kv_put`` to the Decode agent, each below the socket's frame cap): two socket round trips
per frame instead of about one per 3 MiB.
"""
from __future__ import annotations

import time
import uuid

from channels.db import database_sync_to_async
from django.conf import settings

from moe.backbone import BackboneError
from moe.backbone.weights import BACKBONE_KEY
from router.detokenize import settled_text
from router.generate import check_size, encode_prompts_async, generation_carrier, served_model_cached
from moe.handoff import chunk_size, sampling_to_header
from router.ws import AgentLink, AgentUnavailable
from registry.models import MoeModel, Provider
from registry.selectors import live_providers

AGENT_TIMEOUT_S = 600.0


class NoRoleAgent(BackboneError):
    """No live agent holds a role the disaggregated run needs (field ``handoff``)."""

    def __init__(self, message: str):
        super().__init__(message, "handoff")


def pick_agents() -> tuple[str, str]:
    """(Prefill provider, Decode provider) among live agents: a dedicated ``Prefill`` /
    ``Decode`` agent when there is one, else a ``PrefillDecode`` one; two distinct agents
    when possible. Raises ``NoRoleAgent``."""
    rows = list(live_providers().order_by("provider").values_list("provider", "roles"))

    def first(role: str, avoid: str | None = None) -> str | None:
        for want in (role, "PrefillDecode"):
            for pid, roles in rows:
                if want in roles and pid != avoid:
                    return pid
        return None

    pre = first("Prefill")
    if pre is None:
        raise NoRoleAgent("no live agent with role Prefill or PrefillDecode (start one with holder_agent --role)")
    dec = first("Decode", avoid=pre) or first("Decode")
    if dec is None:
        raise NoRoleAgent("no live agent with role Decode or PrefillDecode (start one with holder_agent --role)")
    return pre, dec


async def relay(link: AgentLink, pre: str, dec: str, session: str, nbytes: int, chunk: int) -> tuple[int, int, int]:
    """Move ``nbytes`` of handoff from ``pre`` to ``dec`` through the site: ``kv_get`` /
    ``kv_put`` socket frames below the frame cap. Returns (bytes moved, frames, frame size)."""
    size = min(chunk, chunk_size(settings.TENZRO["WS_MAX_MESSAGE"]))
    frames = -(-nbytes // size)
    moved = 0
    for i in range(frames):
        _, data = await link.request(pre, {"type": "kv_get", "session": session, "index": i, "chunk": size},
                                     timeout=AGENT_TIMEOUT_S)
        moved += len(data)
        await link.request(dec, {"type": "kv_put", "session": session, "index": i, "frames": frames}, data,
                           timeout=AGENT_TIMEOUT_S)
    return moved, frames, size


async def generate_handoff(model_id: str, prompt, sampling, carrier: str = "auto",
                           prompt_field: str = "input_ids") -> dict:
    """``tenzro_moeGenerate`` with ``handoff: true``: prefill on a Prefill agent, KV cache
    moved to a Decode agent (peer to peer, or relayed: module docstring), decode there. Same
    output fields as ``router.generate.generate`` (no ``prompt_logits``) plus ``kv_handoff
    {bytes, kv_bytes, frames, chunk, bytes_per_token, from, to, path}`` (bytes moved, of which
    f32 cache bytes; per prompt token; ``path`` "iroh" or "http" peer to peer, "site"
    relayed, with ``peer_error`` when a peer send failed first; ``send_ms`` the Prefill
    agent's own time sending it peer to peer); ``timings_ms.handoff`` (as the site saw it,
    its ``kv_send`` round trip to the Prefill agent included).

    Raises ``NoBackbone``, ``BackboneError``, ``NoRoleAgent`` and ``AgentUnavailable``
    (an agent failed or timed out; its message is kept).
    """
    t0 = time.perf_counter()
    served = await served_model_cached(model_id)
    prompts = await encode_prompts_async(served, prompt, prompt_field)
    check_size(served, prompts, sampling, prompt_field)

    def describe() -> tuple[dict, dict, tuple[str, str]]:
        m = MoeModel.objects.get(model_id=model_id)
        cfg = {k: v for k, v in m.config.items() if k != BACKBONE_KEY}
        return cfg, m.config[BACKBONE_KEY], pick_agents()

    config, record, (pre, dec) = await database_sync_to_async(describe)()
    to = await database_sync_to_async(lambda: Provider.objects.filter(provider=dec).values(
        "http_endpoint", "iroh_endpoint_id", "iroh_addrs").first() or {})()
    session = uuid.uuid4().hex
    common = {"session": session, "model_id": model_id, "config": config, "record": record,
              "moe_layers": sorted(served.moe_layers), "dense_layers": sorted(served.dense_layers),
              "sampling": sampling_to_header(sampling), "carrier": generation_carrier(carrier)}
    link = await AgentLink.get()
    info, _ = await link.request(pre, {"type": "prefill", **common, "prompts": [p.tolist() for p in prompts]},
                                 timeout=AGENT_TIMEOUT_S)
    t_pre = time.perf_counter()
    path, moved, frames, size, peer_error, send_ms = "site", 0, 0, 0, None, None
    if settings.TENZRO.get("KV_HANDOFF", "peer") == "peer" and (to.get("http_endpoint") or to.get("iroh_endpoint_id")):
        try:
            sent, _ = await link.request(pre, {"type": "kv_send", "session": session,
                                               "to": {"provider": dec, **to}}, timeout=AGENT_TIMEOUT_S)
            path, moved, frames = sent["transport"], int(sent["bytes"]), int(sent["frames"])
            send_ms = sent.get("ms")
            size = -(-moved // max(1, frames))
        except AgentUnavailable as exc:  # unreachable peer, an old agent: the socket relay still works
            peer_error = str(exc)
    if path == "site":
        moved, frames, size = await relay(link, pre, dec, session, int(info["bytes"]), int(info["chunk"]))
    if moved != int(info["bytes"]):
        raise AgentUnavailable(f"KV handoff moved {moved} of {info['bytes']} bytes")
    t_move = time.perf_counter()
    out, _ = await link.request(dec, {"type": "decode", **common, "from": pre}, timeout=AGENT_TIMEOUT_S)
    total = (time.perf_counter() - t0) * 1e3
    outs = out["output_ids"]
    new = sum(len(o) for o in outs)
    single = not (isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)))
    ptoks = int(sum(p.size for p in prompts))
    result = {"model_id": model_id, "output_ids": outs[0] if single else outs,
              "finish_reasons": out["finish_reasons"], "prompt_tokens": ptoks,
              "kv_handoff": {"bytes": moved, "kv_bytes": int(info["kv_bytes"]), "frames": frames, "chunk": size,
                             "bytes_per_token": round(moved / ptoks, 3), "from": pre, "to": dec, "path": path,
                             **({"peer_error": peer_error} if peer_error else {}),
                             **({"send_ms": send_ms} if send_ms is not None else {})},
              "layers": {"forwards": int(info["forwards"]) + int(out["forwards"])},
              "timings_ms": {"prefill": info["prefill_ms"], "handoff": round((t_move - t_pre) * 1e3, 3),
                             "decode": out["decode_ms"], "total": round(total, 3)},
              "tokens_per_s": round(new / (total / 1e3), 3) if total > 0 else None,
              "decode_tokens_per_s": (round((new - len(outs)) / (out["decode_ms"] / 1e3), 3)
                                      if out["decode_ms"] > 0 else None)}
    if served.tokenizer is not None:
        texts = [settled_text(served.detokenizer(sampling), o) for o in outs]
        result["text"] = texts[0] if single else texts
    return result
