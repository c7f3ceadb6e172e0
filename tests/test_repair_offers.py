"""A mute agent (heartbeats a Warm holding, never answers its repair offer) costs the pass
``TENZRO_REPAIR_OFFER_TIMEOUT`` seconds, not the period (issue 24 item 6: it held the pass for
300 s before, and later periods were skipped)."""
from __future__ import annotations

import asyncio
import json

import pytest
from channels.db import database_sync_to_async
from nacl.signing import SigningKey

from moe import wire
from moe.identity import provider_id
from registry.models import Provider
from router import repair
from router.ws import AgentLink
from tests.conftest import holding, signed_heartbeat
from tests.test_agent_socket import authed

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.asyncio]


async def test_a_mute_agent_does_not_hold_the_repair_pass(settings):
    settings.TENZRO = {**settings.TENZRO, "REPAIR_OFFER_TIMEOUT_S": 3.0, "REPAIR_INTERVAL_S": 3600}
    mute, talker = SigningKey.generate(), SigningKey.generate()
    comms = {}
    for key in (mute, talker):
        comms[key] = comm = await authed(key)
        await comm.send_json_to(signed_heartbeat(key, [holding(expert=0)]))
        assert (await comm.receive_json_from(30))["type"] == "heartbeat_ack"

    async def answer_offer(comm):
        header, _ = wire.unpack_frame(await comm.receive_from(30))
        assert header["type"] == "repair"
        outcome = {"accepted": [], "declined": [], "released": [], "fetched_bytes": 0}
        await comm.send_to(bytes_data=wire.pack_frame({"id": header["id"], "ok": True}, json.dumps(outcome).encode()))
        return header

    talking = asyncio.ensure_future(answer_offer(comms[talker]))
    # A generous deadline: the old pass waited 300 s for the mute agent.
    rp = await asyncio.wait_for(repair.run_pass("test"), 120)
    await talking
    assert rp is not None and rp["status"] == "done", rp
    assert "did not answer within 3 s" in rp["error"] and provider_id(mute)[:12] in rp["error"]
    assert provider_id(talker)[:12] not in rp["error"]

    # The offer reached the mute agent; its late answer is dropped, and the socket still serves
    # the next request; both agents stay connected.
    late, _ = wire.unpack_frame(await comms[mute].receive_from(30))
    assert late["type"] == "repair"
    await comms[mute].send_to(bytes_data=wire.pack_frame({"id": late["id"], "ok": True}, b"{}"))
    link = await AgentLink.get()
    asking = asyncio.ensure_future(link.request(provider_id(mute), {"type": "status"}, timeout=30))
    req, _ = wire.unpack_frame(await comms[mute].receive_from(30))
    await comms[mute].send_to(bytes_data=wire.pack_frame({"id": req["id"], "ok": True}, b"fine"))
    assert (await asking)[1] == b"fine"
    connected = await database_sync_to_async(lambda: set(
        Provider.objects.filter(connected=True).values_list("provider", flat=True)))()
    assert connected == {provider_id(mute), provider_id(talker)}
    for comm in comms.values():
        await comm.disconnect()
