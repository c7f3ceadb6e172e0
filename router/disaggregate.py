"""Disaggregated generation on the site: prefill on an agent with role ``Prefill``, the KV
cache handed over the agent socket to an agent with role ``Decode``, decode there
(``moe.handoff`` is the agent side). The site only picks the agents and relays the
handoff frames (``kv_get`` from the Prefill agent, ``kv_put`` to the Decode agent, each
below the socket's frame cap); both agents run the backbone and call the site's distributed
forward for every MLP layer.
"""
from __future__ import annotations

import time
import uuid

from channels.db import database_sync_to_async
from django.conf import settings

from moe.backbone import BackboneError
from moe.backbone.weights import BACKBONE_KEY
from router.detokenize import settled_text
from router.generate import check_size, encode_prompts, generation_carrier, served_model
from moe.handoff import chunk_size, sampling_to_header
from router.ws import AgentLink, AgentUnavailable
from registry.models import MoeModel
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


async def generate_handoff(model_id: str, prompt, sampling, carrier: str = "auto",
                           prompt_field: str = "input_ids") -> dict:
    """``tenzro_moeGenerate`` with ``handoff: true``: prefill on a Prefill agent, KV cache
    moved in frames to a Decode agent, decode there. Same output fields as
    ``router.generate.generate`` (no ``prompt_logits``) plus ``kv_handoff {bytes, kv_bytes,
    frames, chunk, bytes_per_token, from, to}`` (bytes on the socket, of which f32 cache
    bytes; per prompt token).

    Raises ``NoBackbone``, ``BackboneError``, ``NoRoleAgent`` and ``AgentUnavailable``
    (an agent failed or timed out; its message is kept).
    """
    t0 = time.perf_counter()
    served = await database_sync_to_async(served_model)(model_id)
    prompts = encode_prompts(served, prompt, prompt_field)
    check_size(served, prompts, sampling, prompt_field)

    def describe() -> tuple[dict, dict, tuple[str, str]]:
        m = MoeModel.objects.get(model_id=model_id)
        cfg = {k: v for k, v in m.config.items() if k != BACKBONE_KEY}
        return cfg, m.config[BACKBONE_KEY], pick_agents()

    config, record, (pre, dec) = await database_sync_to_async(describe)()
    session = uuid.uuid4().hex
    common = {"session": session, "model_id": model_id, "config": config, "record": record,
              "moe_layers": sorted(served.moe_layers), "dense_layers": sorted(served.dense_layers),
              "sampling": sampling_to_header(sampling), "carrier": generation_carrier(carrier)}
    link = await AgentLink.get()
    info, _ = await link.request(pre, {"type": "prefill", **common, "prompts": [p.tolist() for p in prompts]},
                                 timeout=AGENT_TIMEOUT_S)
    t_pre = time.perf_counter()
    size = min(int(info["chunk"]), chunk_size(settings.TENZRO["WS_MAX_MESSAGE"]))
    frames = -(-int(info["bytes"]) // size)
    moved = 0
    for i in range(frames):
        _, chunk = await link.request(pre, {"type": "kv_get", "session": session, "index": i, "chunk": size},
                                      timeout=AGENT_TIMEOUT_S)
        moved += len(chunk)
        await link.request(dec, {"type": "kv_put", "session": session, "index": i, "frames": frames}, chunk,
                           timeout=AGENT_TIMEOUT_S)
    if moved != int(info["bytes"]):
        raise AgentUnavailable(f"KV handoff moved {moved} of {info['bytes']} bytes")
    t_move = time.perf_counter()
    out, _ = await link.request(dec, {"type": "decode", **common}, timeout=AGENT_TIMEOUT_S)
    total = (time.perf_counter() - t0) * 1e3
    outs = out["output_ids"]
    new = sum(len(o) for o in outs)
    single = not (isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)))
    ptoks = int(sum(p.size for p in prompts))
    result = {"model_id": model_id, "output_ids": outs[0] if single else outs,
              "finish_reasons": out["finish_reasons"], "prompt_tokens": ptoks,
              "kv_handoff": {"bytes": moved, "kv_bytes": int(info["kv_bytes"]), "frames": frames, "chunk": size,
                             "bytes_per_token": round(moved / ptoks, 3), "from": pre, "to": dec},
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
