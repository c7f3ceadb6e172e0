"""The agent's side sockets (``holders.session``): behind a balancer of several site processes
the welcome lists them, and the agent holds one more socket to each other process
(``/ws/agent/?site=<id>``), answers each request on the socket it came on, and retries a side
socket the balancer sent to the wrong process (4421) without touching its main socket."""
from __future__ import annotations

import asyncio
import json
from urllib.parse import parse_qs, urlsplit

from nacl.signing import SigningKey
from websockets.asyncio.server import serve

from holders.agent import AgentConfig, HolderAgent
from moe import messages, wire


def test_the_agent_holds_a_side_socket_to_each_other_site_process_and_answers_on_it(tmp_path):
    seen: list[str | None] = []  # the ?site= of each socket opened, in order
    answers: asyncio.Queue = asyncio.Queue()

    async def site(ws):
        side = (parse_qs(urlsplit(ws.request.path).query).get("site") or [None])[0]
        seen.append(side)
        await ws.send(json.dumps(messages.challenge(b"\x00" * 32)))
        hello = json.loads(await ws.recv())
        if side == "b" and seen.count("b") == 1:  # the first try reached the wrong process
            await ws.send(json.dumps(messages.socket_error("this is site process 'a', not 'b'", code=4421)))
            await ws.close(code=4421)
            return
        await ws.send(json.dumps(messages.welcome(hello["provider"], 1 << 20, 15, "d", side or "a", ("a", "b"))))
        if side == "b":
            await ws.send(wire.pack_frame({"type": "nonsense", "id": "q1"}))
        async for frame in ws:
            if isinstance(frame, bytes):
                await answers.put((side, wire.unpack_frame(frame)[0]))

    async def go():
        server = await serve(site, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        agent = HolderAgent(AgentConfig(url, SigningKey.generate(), tmp_path, name="n"))
        run = asyncio.create_task(agent.session.run())
        try:
            side, header = await asyncio.wait_for(answers.get(), 20)
            assert side == "b" and header["id"] == "q1" and header["ok"] is False and header["code"] == "bad_request"
        finally:
            run.cancel()  # (stop() is seen at the site's next frame; this fake site sends none)
            await asyncio.gather(run, return_exceptions=True)
            server.close()
        assert seen[0] is None and seen[1:] == ["b", "b"]  # main, the misdirected side try, its retry
        assert not agent.session._side  # stopping closed the side sockets

    asyncio.run(go())
