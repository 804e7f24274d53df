"""The web worker's link to the renderer: one DEALER socket per worker process.

Knows the wire messages and nothing of HTTP, text templates or tokens. Requests go out as
one msgpack frame; the renderer's ROUTER answers each to this worker's identity, and a
reader task hands every answer to the asyncio queue of the request (`rid`) it belongs to.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from typing import AsyncIterator

import msgspec
import zmq
import zmq.asyncio

from common.config import Settings
from common.messages import (Accepted, CancelRequest, Delta, Failed, Finished, GenerateRequest, Health,
                             PingRequest, Started, Waiting, WebIn)
from common.sockets import RENDERER, address

log = logging.getLogger("web")

NOT_ANSWERING = "renderer not answering"
SEND_TIMEOUT_S = 60.0       # no renderer connected this long: the request fails with 503
WAIT_NOTICE_S = 1.0         # no renderer connected this long: the request is told it Waits
NO_RENDERER_YET = "waiting for the renderer process"
ACCEPT_TIMEOUT_S = 60.0     # the renderer answers Accepted/Failed right after tokenizing
IDLE_CHECK_S = 15.0         # a request silent this long asks the renderer whether it still holds it
IDLE_PING_TIMEOUT_S = 5.0

Event = Accepted | Started | Delta | Finished | Failed | Waiting


def new_rid() -> str:
    return uuid.uuid4().hex


class RendererUnavailable(Exception):
    pass


class ZmqBackend:
    """`submit` / `cancel` / `health`, multiplexed over one socket. The socket is made in the
    running loop on first use (gunicorn forks workers after loading the app), and made again
    if the process or the loop changed since."""

    def __init__(self, settings: Settings, *, send_timeout: float = SEND_TIMEOUT_S,
                 accept_timeout: float = ACCEPT_TIMEOUT_S, idle_check: float = IDLE_CHECK_S,
                 idle_ping_timeout: float = IDLE_PING_TIMEOUT_S, wait_notice: float = WAIT_NOTICE_S):
        self.settings = settings
        self.send_timeout = send_timeout
        self.wait_notice = wait_notice
        self.accept_timeout = accept_timeout
        self.idle_check = idle_check
        self.idle_ping_timeout = idle_ping_timeout
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(WebIn)
        self._queues: dict[str, asyncio.Queue] = {}
        self._cancelled: set[str] = set()
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._reader: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pid = 0

    # -- socket lifecycle --
    async def start(self) -> None:
        """Connect now (ASGI lifespan startup), so the first request finds the link up."""
        self._ensure()

    def _ensure(self) -> zmq.asyncio.Socket:
        loop = asyncio.get_running_loop()
        if self._sock is not None and self._loop is loop and self._pid == os.getpid():
            return self._sock
        if self._pid == os.getpid():
            self._close_socket()        # same process, another loop: the old one is dead
        # after a fork the parent's context and socket are left alone (never close them here)
        self._queues.clear()
        self._cancelled.clear()
        self._ctx = zmq.asyncio.Context()
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)      # queue nothing while no renderer is connected
        sock.setsockopt(zmq.SNDHWM, 10_000)
        sock.setsockopt(zmq.RCVHWM, 200_000)   # token deltas of every request in this worker
        sock.connect(address(self.settings, RENDERER))
        self._sock, self._loop, self._pid = sock, loop, os.getpid()
        self._reader = loop.create_task(self._read(sock))
        return sock

    def _close_socket(self) -> None:
        try:
            if self._reader is not None:
                self._reader.cancel()
        except RuntimeError:        # its loop is closed already
            pass
        if self._sock is not None:
            self._sock.close(linger=0)
        if self._ctx is not None:
            self._ctx.term()
        self._sock = self._ctx = self._reader = None

    async def close(self) -> None:
        if self._pid == os.getpid():
            reader = self._reader
            self._close_socket()
            if reader is not None:
                try:
                    await reader
                except BaseException:
                    pass
        self._queues.clear()

    async def _read(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            try:
                frames = await sock.recv_multipart()
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError as e:
                if sock.closed:
                    return
                log.warning("renderer socket: %s", e)
                await asyncio.sleep(0.1)
                continue
            try:
                msg = self._dec.decode(frames[-1])
            except (msgspec.DecodeError, IndexError) as e:
                log.warning("undecodable message from the renderer: %s", e)
                continue
            q = self._queues.get(msg.rid)
            if q is not None:
                q.put_nowait(msg)

    async def _send(self, msg, timeout: float | None = None) -> None:
        sock = self._ensure()
        data = self._enc.encode(msg)
        try:
            await asyncio.wait_for(sock.send(data), self.send_timeout if timeout is None else timeout)
        except (asyncio.TimeoutError, zmq.ZMQError) as e:
            raise RendererUnavailable(str(e) or "no renderer connected") from None

    def _send_nowait(self, msg) -> None:
        """Fire and forget (cancels from cleanup code, which must not block)."""
        if self._sock is None or self._pid != os.getpid():
            return
        try:
            fut = self._sock.send(self._enc.encode(msg), flags=zmq.NOBLOCK)
            fut.add_done_callback(lambda f: f.cancelled() or f.exception())
        except (zmq.ZMQError, RuntimeError):
            pass

    # -- the API --
    async def submit(self, req: GenerateRequest) -> AsyncIterator[Event]:
        """Accepted, Delta..., then Finished or Failed, after which the iterator ends; Waiting
        (any number, first) while no renderer is connected or the renderer is not ready.
        Leaving the iterator early (aclose, cancellation) cancels the request."""
        rid = req.rid
        self._ensure()
        q: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = q
        done = False
        send = asyncio.ensure_future(self._send(req))
        try:
            try:
                if not (await asyncio.wait({send}, timeout=self.wait_notice))[0]:
                    yield Waiting(rid=rid, detail=NO_RENDERER_YET)
                await send
            except RendererUnavailable:
                done = True
                yield Failed(rid=rid, status=503, message="the model server is not available (no renderer)",
                             code="renderer_unavailable", err_type="server_error")
                return
            first = True
            while True:
                try:
                    ev = await asyncio.wait_for(q.get(), self.accept_timeout if first else self.idle_check)
                except asyncio.TimeoutError:
                    why = NOT_ANSWERING
                    if not first:
                        h = await self.health(self.idle_ping_timeout, about=rid)
                        if h.holds or not q.empty():    # an answer may have come meanwhile
                            continue
                        if h.detail != NOT_ANSWERING:   # alive, but a restarted one
                            why = "the renderer restarted and lost this request"
                    # done stays False: the renderer may still hold it, the finally cancels it
                    yield Failed(rid=rid, status=503, message=f"{why} (request {rid})",
                                 code="renderer_unavailable", err_type="server_error")
                    return
                first = False
                if isinstance(ev, Health):
                    continue
                if isinstance(ev, (Finished, Failed)):
                    done = True
                yield ev
                if done:
                    return
        finally:
            if not send.done():
                send.cancel()
            self._queues.pop(rid, None)
            if not done and rid not in self._cancelled:
                self._send_nowait(CancelRequest(rid=rid))
            self._cancelled.discard(rid)

    async def cancel(self, rid: str) -> None:
        if rid in self._queues:
            self._cancelled.add(rid)
        self._ensure()
        self._send_nowait(CancelRequest(rid=rid))

    async def health(self, timeout: float = 1.0, about: str = "", slots: bool = False) -> Health:
        """The renderer's Health; `about` asks whether it holds that request, `slots` for
        its sessions."""
        rid = new_rid()
        deadline = time.monotonic() + timeout
        self._ensure()
        q: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = q
        try:
            await self._send(PingRequest(rid=rid, about=about, slots=slots), timeout=timeout)
            while True:
                ev = await asyncio.wait_for(q.get(), max(deadline - time.monotonic(), 0.001))
                if isinstance(ev, Health):
                    return ev
        except (RendererUnavailable, asyncio.TimeoutError):
            return Health(rid=rid, ready=False, detail=NOT_ANSWERING)
        finally:
            self._queues.pop(rid, None)
