"""Issue 15 item 1: an agent declares an expert only after a warm-up batch ran, and every holding
Cold while its kernels still compile, so no router plans a first-call compile inside its deadline."""
from __future__ import annotations

import asyncio

import numpy as np
from nacl.signing import SigningKey

from holders.agent import AgentConfig, HolderAgent
from moe.faults import BLACKHOLE_TPS, FaultInjector, parse_fault
from moe.ffn import ExpertWeights
from moe.content import blob_uri
from registry.heartbeat import parse_holdings
from moe.identity import provider_id


def declared(agent) -> list[dict]:
    """The holdings of a fresh heartbeat of ``agent``, expanded from the compact form."""
    return parse_holdings(agent.session.heartbeat_message()["body"]["holdings"])


def _blob():
    rng = np.random.default_rng(0)
    w = ExpertWeights(*(rng.standard_normal(s).astype(np.float32) * 0.05 for s in ((32, 64), (32, 64), (64, 32))))
    return w.to_blob("f32")


def test_an_expert_is_declared_only_after_its_warm_up_batch(tmp_path):
    agent = HolderAgent(AgentConfig("http://127.0.0.1:1", SigningKey.generate(), tmp_path / "blobs"))
    assert agent.loader.kernels_warm.wait(120)
    blob = _blob()
    uri = agent.store.put(blob)
    agent.loader.fetch = lambda _uri: blob
    seen = []
    warm = agent.loader.warm_expert

    def watching(key, d_model):
        seen.append(declared(agent))  # during the warm-up
        warm(key, d_model)

    agent.loader.warm_expert = watching
    executed = agent.runtime.meter.tokens()

    async def go():
        agent.session.loop = asyncio.get_running_loop()
        await agent.loader.load({"model_id": "m", "layer": 1, "expert": 3, "uri": blob_uri(uri)})

    asyncio.run(go())
    assert seen == [[]]  # loaded, not yet run once: not declared
    after = declared(agent)
    assert [(h["expert"], h["residency"]) for h in after] == [(3, "Warm")]
    assert agent.runtime.meter.tokens() == executed  # the warm-up batch is not metered


def test_holdings_are_cold_while_the_kernels_compile(tmp_path):
    agent = HolderAgent(AgentConfig("http://127.0.0.1:1", SigningKey.generate(), tmp_path / "blobs"))
    agent.loader.kernels_warm.wait(120)
    agent.runtime.load_expert("m", 1, 2, _blob())
    agent.loader.kernels_warm.clear()  # as right after start, before the JIT finished
    assert [h["residency"] for h in declared(agent)] == ["Cold"]
    agent.loader.kernels_warm.set()
    assert [h["residency"] for h in declared(agent)] == ["Warm"]


def test_blackhole_fault_declares_every_expert_warm_at_a_huge_rate():
    assert str(parse_fault("blackhole")) == "blackhole"
    fi = FaultInjector(parse_fault("blackhole"))
    own = [{"model_id": "m", "layer": 1, "expert": 0, "residency": "Cold", "committed_tps": 0,
            "blob_uri": "tenzro://blob/" + "a" * 64}]
    others = [{"provider": provider_id(SigningKey.generate()), "model_id": "m", "layer": 1, "expert": e,
               "residency": "Warm", "committed_tps": 5, "blob_uri": None} for e in (0, 1, 2)]
    out = fi.advertise(own, others)
    assert [(h["expert"], h["residency"], h["committed_tps"]) for h in out] == \
        [(e, "Warm", BLACKHOLE_TPS) for e in (0, 1, 2)]
    assert FaultInjector(parse_fault("stall:1")).advertise(own, others) == own
