"""A user-space WAN emulator: an asyncio proxy adding one-way delay, jitter, a bandwidth cap and
loss between a client and a server (issue 22; the kernel here has no ``netem``).

``WanProxy(target_port, link=Link(...), udp=False)`` listens on ``127.0.0.1:port`` (a free one
unless given) and forwards every TCP connection (agent socket, HTTP) — or, with ``udp``,
every datagram (iroh's QUIC) — to ``127.0.0.1:target_port``, each direction delayed by
``Link``. It runs its own event loop in a daemon thread: ``start()`` / ``stop()`` or a
``with`` block; ``set_link(link)`` changes the link for bytes read from then on (live
connections included), so one cluster can be measured at several RTTs.

What each direction does to a chunk read at time ``t`` (``n`` bytes):

- **bandwidth**: the chunk leaves the sender after the ones before it, ``n / bandwidth_bps``
  seconds each (a serialization queue, as a link of that rate);
- **delay and jitter**: it arrives ``delay_s`` later, plus a uniform jitter in
  ``[-jitter_s, +jitter_s]`` (never below zero);
- **loss**: on TCP a lost segment is retransmitted, so with probability ``loss`` the chunk
  arrives ``retransmit_s`` later (default ``max(0.2, 2 × delay_s)``: Linux's minimum RTO, or
  a round trip); TCP keeps order, so later chunks wait behind it (head-of-line blocking).
  On UDP the datagram is dropped and jitter may reorder datagrams, as on the internet.

Seeded (``seed``) so a run's losses and jitter repeat. Pure asyncio; no third-party code.
"""
from __future__ import annotations

import asyncio
import random
import socket
import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class Link:
    """One direction's impairments: ``delay_s`` one-way delay (RTT / 2 per direction),
    ``jitter_s`` (uniform ±), ``bandwidth_bps`` bytes per second (None: unlimited), ``loss``
    probability 0..1 per chunk / datagram, ``retransmit_s`` a TCP loss's extra delay (None:
    ``max(0.2, 2 × delay_s)``). Raises ``ValueError`` for negative values or loss ≥ 1."""

    delay_s: float = 0.0
    jitter_s: float = 0.0
    bandwidth_bps: float | None = None
    loss: float = 0.0
    retransmit_s: float | None = None

    def __post_init__(self):
        if self.delay_s < 0 or self.jitter_s < 0 or (self.retransmit_s is not None and self.retransmit_s < 0):
            raise ValueError(f"delay, jitter and retransmit must be ≥ 0, got {self}")
        if self.bandwidth_bps is not None and self.bandwidth_bps <= 0:
            raise ValueError(f"bandwidth_bps must be > 0 or None, got {self.bandwidth_bps}")
        if not 0 <= self.loss < 1:
            raise ValueError(f"loss must be in [0, 1), got {self.loss}")

    @classmethod
    def rtt(cls, rtt_ms: float, jitter_ms: float = 0.0, bandwidth_bps: float | None = None,
            loss: float = 0.0) -> "Link":
        """The per-direction link of a path with round trip ``rtt_ms`` (half each way)."""
        return cls(rtt_ms / 2e3, jitter_ms / 2e3, bandwidth_bps, loss)

    @property
    def retransmit(self) -> float:
        """Seconds a lost TCP segment adds."""
        return self.retransmit_s if self.retransmit_s is not None else max(0.2, 2 * self.delay_s)


class _Shaper:
    """One direction's clock: when a chunk of ``n`` bytes read now is delivered."""

    def __init__(self, proxy: "WanProxy", ordered: bool):
        self.proxy, self.ordered = proxy, ordered
        self.tx_free = 0.0  # when the link finishes sending what is queued (bandwidth)
        self.last = 0.0  # delivery time of the previous chunk (TCP keeps order)

    def due(self, now: float, n: int) -> float | None:
        link, rng = self.proxy.link, self.proxy.rng
        start = max(now, self.tx_free)
        self.tx_free = start + (n / link.bandwidth_bps if link.bandwidth_bps else 0.0)
        at = self.tx_free + max(0.0, link.delay_s + (rng.uniform(-link.jitter_s, link.jitter_s)
                                                      if link.jitter_s else 0.0))
        if link.loss and rng.random() < link.loss:
            if not self.ordered:
                self.proxy.stats["dropped"] += 1
                return None
            at += link.retransmit
            self.proxy.stats["retransmits"] += 1
        if self.ordered:
            at = max(at, self.last)
            self.last = at
        return at


class WanProxy:
    """The emulator (module docstring). ``port``: where it listens (0: a free one, read
    ``port`` after ``start``); ``target_port``: the server's port on 127.0.0.1; ``udp``: a
    datagram proxy instead of TCP. ``stats``: bytes each way, connections, retransmits and
    drops so far."""

    def __init__(self, target_port: int, link: Link = Link(), port: int = 0, udp: bool = False, seed: int = 0,
                 host: str = "127.0.0.1"):
        self.target_port, self.link, self.port, self.udp, self.host = target_port, link, port, udp, host
        self.rng = random.Random(seed)
        self.stats = {"up_bytes": 0, "down_bytes": 0, "connections": 0, "retransmits": 0, "dropped": 0}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None

    def set_link(self, link: Link) -> None:
        """Use ``link`` for every byte read from now on (both directions, every connection)."""
        self.link = link

    @property
    def url(self) -> str:
        """``http://127.0.0.1:port`` (for ``--agent-site``)."""
        return f"http://{self.host}:{self.port}"

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> "WanProxy":
        """Bind and serve in a daemon thread; returns once listening. Raises ``OSError`` when
        the port cannot be bound."""
        if not self.port:
            kind = socket.SOCK_DGRAM if self.udp else socket.SOCK_STREAM
            with socket.socket(socket.AF_INET, kind) as s:
                s.bind((self.host, 0))
                self.port = s.getsockname()[1]
        self._thread = threading.Thread(target=self._main, name=f"wan-proxy-{self.port}", daemon=True)
        self._thread.start()
        self._ready.wait(10)
        if self._error is not None:
            raise self._error
        return self

    def stop(self) -> None:
        """Close the listener and every connection; safe to call twice."""
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._stop.set)
            except RuntimeError:
                pass
        if self._thread is not None:
            self._thread.join(10)
            self._thread = None

    def __enter__(self) -> "WanProxy":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _main(self) -> None:
        loop = self._loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(self._serve())
        except BaseException as exc:  # surfaced by start()
            self._error = exc
            self._ready.set()
        finally:
            loop.close()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        tasks: set[asyncio.Task] = set()
        if self.udp:
            transport, _ = await asyncio.get_running_loop().create_datagram_endpoint(
                lambda: _UdpFront(self, tasks), local_addr=(self.host, self.port))
            self._ready.set()
            await self._stop.wait()
            transport.close()
        else:
            async def accept(reader, writer):
                task = asyncio.current_task()
                tasks.add(task)
                try:
                    await self._tcp(reader, writer)
                except asyncio.CancelledError:  # stop(): end quietly (the server logs a cancelled handler)
                    writer.close()
                finally:
                    tasks.discard(task)

            server = await asyncio.start_server(accept, self.host, self.port, backlog=1024)
            self._ready.set()
            await self._stop.wait()
            server.close()
        for t in list(tasks):
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- TCP -----------------------------------------------------------------------------------

    async def _tcp(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        try:
            s_reader, s_writer = await asyncio.open_connection(self.host, self.target_port)
        except OSError:
            c_writer.close()
            return
        self.stats["connections"] += 1
        for w in (c_writer, s_writer):
            sock = w.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        pipes = [asyncio.create_task(self._pipe(c_reader, s_writer, "up_bytes")),
                 asyncio.create_task(self._pipe(s_reader, c_writer, "down_bytes"))]
        try:  # each direction ends at its EOF (a half-close passes through) or an error
            await asyncio.gather(*pipes, return_exceptions=True)
        finally:
            for p in pipes:
                p.cancel()
            await asyncio.gather(*pipes, return_exceptions=True)
            for w in (c_writer, s_writer):
                w.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, counter: str) -> None:
        """Read chunks as they come, deliver each at its due time, in order; EOF closes the
        write side once everything before it was delivered."""
        loop = asyncio.get_running_loop()
        shaper = _Shaper(self, ordered=True)
        queue: asyncio.Queue = asyncio.Queue()

        async def deliver():
            while True:
                item = await queue.get()
                if item is None:
                    if writer.can_write_eof():
                        writer.write_eof()
                    return
                at, data = item
                delay = at - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                writer.write(data)
                await writer.drain()

        sender = asyncio.create_task(deliver())
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    break
                self.stats[counter] += len(data)
                queue.put_nowait((shaper.due(loop.time(), len(data)), data))
            queue.put_nowait(None)
            await sender
        except (ConnectionError, OSError):
            pass
        finally:
            sender.cancel()


class _UdpFront(asyncio.DatagramProtocol):
    """The UDP listener: one upstream socket per client address, datagrams delayed or dropped."""

    def __init__(self, proxy: WanProxy, tasks: set):
        self.proxy, self.tasks = proxy, tasks
        self.transport: asyncio.DatagramTransport | None = None
        self.peers: dict[tuple, tuple[asyncio.DatagramTransport, _Shaper, _Shaper]] = {}
        self.opening: dict[tuple, asyncio.Future] = {}  # client address → its upstream socket being opened

    def connection_made(self, transport):
        self.transport = transport

    def datagram_received(self, data: bytes, addr: tuple) -> None:
        peer = self.peers.get(addr)
        if peer is not None:  # the common case, without a task per datagram
            self._send(peer, data)
            return
        task = asyncio.get_running_loop().create_task(self._forward(data, addr))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _forward(self, data: bytes, addr: tuple) -> None:
        loop = asyncio.get_running_loop()
        peer = self.peers.get(addr)
        if peer is None and addr in self.opening:
            await self.opening[addr]
            peer = self.peers[addr]
        if peer is None:
            self.opening[addr] = opened = loop.create_future()
            front, proxy = self, self.proxy

            class Back(asyncio.DatagramProtocol):
                def datagram_received(self, reply: bytes, _src) -> None:
                    proxy.stats["down_bytes"] += len(reply)
                    at = front.peers[addr][2].due(loop.time(), len(reply))
                    if at is not None:
                        loop.call_at(at, front.transport.sendto, reply, addr)

            back, _ = await loop.create_datagram_endpoint(Back, remote_addr=(proxy.host, proxy.target_port))
            peer = self.peers[addr] = (back, _Shaper(proxy, False), _Shaper(proxy, False))
            del self.opening[addr]
            opened.set_result(None)
            self.proxy.stats["connections"] += 1
        self._send(peer, data)

    def _send(self, peer: tuple, data: bytes) -> None:
        self.proxy.stats["up_bytes"] += len(data)
        loop = asyncio.get_running_loop()
        at = peer[1].due(loop.time(), len(data))
        if at is not None:
            loop.call_at(at, peer[0].sendto, data)
