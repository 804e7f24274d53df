"""Waiting on a request's events and on the client at once.

Knows ASGI and asyncio; nothing of tokens. `Receive` wraps the ASGI receive callable so that
more than one waiter (falcon's SSE disconnect watcher, ours) can listen for
`http.disconnect` without two reads racing on the server; `Pump` yields the backend's next
event, a keepalive tick, or the news that the client left.
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator

TIMEOUT = "timeout"             # no event within the wait: time for a keepalive
DISCONNECTED = "disconnected"   # the client went away
END = "end"                     # the backend's iterator ended


class Receive:
    """One read of the real `receive` in flight at a time, shared by all callers; a caller
    that gives up (is cancelled) leaves it running for the next. Use it only once the
    request body has been read, or from the one body reader."""

    def __init__(self, receive):
        self._receive = receive
        self._pending: asyncio.Future | None = None
        self.disconnected = asyncio.Event()

    async def __call__(self) -> dict:
        if self.disconnected.is_set():
            return {"type": "http.disconnect"}
        if self._pending is None:
            self._pending = asyncio.ensure_future(self._receive())
        fut = self._pending
        try:
            msg = await asyncio.shield(fut)
        finally:
            if fut.done() and self._pending is fut:
                self._pending = None
        if msg.get("type") == "http.disconnect":
            self.disconnected.set()
        return msg

    async def wait_disconnect(self) -> None:
        while not self.disconnected.is_set():
            await self()

    def close(self) -> None:
        """The response is over: stop the read still waiting for the disconnect."""
        fut, self._pending = self._pending, None
        if fut is not None and not fut.done():
            fut.cancel()


async def _anext(it):
    return await it.__anext__()


class Pump:
    """Next event of `events`, TIMEOUT, DISCONNECTED or END. A wait that times out leaves the
    pending read in place (cancelling it would end the backend's iterator)."""

    def __init__(self, events: AsyncIterator, receive: Receive | None):
        self._it = events
        self._rcv = receive
        self._next: asyncio.Future | None = None
        self._disc: asyncio.Future | None = None

    async def next(self, timeout: float | None = None):
        if self._next is None:
            self._next = asyncio.ensure_future(_anext(self._it))
        waits = {self._next}
        if self._rcv is not None:
            if self._disc is None:
                self._disc = asyncio.ensure_future(self._rcv.wait_disconnect())
            waits.add(self._disc)
        done, _ = await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if self._disc is not None and self._disc in done:
            return DISCONNECTED
        if self._next in done:
            task, self._next = self._next, None
            try:
                return task.result()
            except StopAsyncIteration:
                return END
        return TIMEOUT

    async def aclose(self) -> None:
        for t in (self._disc, self._next):
            if t is not None and not t.done():
                t.cancel()
                try:
                    await t
                except BaseException:
                    pass
        self._disc = self._next = None
        close = getattr(self._it, "aclose", None)
        if close is not None:
            try:
                await close()
            except Exception:
                pass
