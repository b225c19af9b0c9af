"""The client's connection: its request headers and body received under a time limit, the body under a size limit,
and its leaving noticed at once."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from starlette.requests import ClientDisconnect, Request
from uvicorn.protocols.http.h11_impl import H11Protocol

from .requests import ApiError


class ClientLeft(Exception):
    """The client closed its connection: there is nobody left to answer. The message says when."""


class TimedH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 connection, closed when a request's headers are not all there receive_timeout_s after the
    connection opened or the previous response ended: uvicorn alone waits forever for a first request, and for one
    sent a byte at a time."""

    def __init__(self, *args, receive_timeout_s: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.receive_timeout_s = receive_timeout_s
        self.request_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport):
        super().connection_made(transport)
        self.expect_request()

    def on_response_complete(self):
        super().on_response_complete()
        self.expect_request()

    def expect_request(self):
        if self.request_deadline is not None:
            self.request_deadline.cancel()
        self.request_deadline = self.loop.call_later(self.receive_timeout_s, self.close_unless_requested, self.cycle)

    def close_unless_requested(self, cycle_before):
        # idle: no request began since, and the one before (if any) is answered; a pipelined request that began
        # inside on_response_complete is running, and re-arms the timer when its own answer ends
        idle = self.cycle is cycle_before and (cycle_before is None or cycle_before.response_complete)
        if idle and not self.transport.is_closing():
            self.transport.close()

    def connection_lost(self, exc):
        self.request_deadline.cancel()
        super().connection_lost(exc)


def shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down; retry on another instance or after it restarts",
                    type_="server_error", code="shutting_down")


async def read_body(request: Request, max_bytes: int, timeout_s: float, closing: asyncio.Event,
                    hold: Callable[[int], None] | None = None) -> bytes:
    """The whole body, or ApiError 413 (larger than max_bytes: refused from its Content-Length before any of it is
    read), 408 (not all there within timeout_s), 503 (the server began shutting down), or ClientLeft. hold(n) is
    called with each chunk's size as it arrives (it may refuse the body by raising ApiError)."""
    too_large = ApiError(413, f"the request body is larger than the server's limit of {max_bytes} bytes "
                         "(--max-body-mb)", code="body_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise too_large
    chunks, size = [], 0

    async def receive_all():
        nonlocal size
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise too_large
            if hold is not None:
                hold(len(chunk))
            chunks.append(chunk)

    receiving = asyncio.ensure_future(receive_all())
    stopping = asyncio.ensure_future(closing.wait())
    try:
        done, _ = await asyncio.wait({receiving, stopping}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        receiving.cancel()
        stopping.cancel()
    if receiving in done:
        try:
            receiving.result()
        except ClientDisconnect:
            raise ClientLeft("before sending its whole body") from None
        return b"".join(chunks)
    if stopping in done:
        raise shutting_down()
    raise ApiError(408, f"the request body did not arrive within {timeout_s:g} s (--receive-timeout)",
                   code="body_timeout")


async def until_disconnected(request: Request):
    """Return when the client closes its connection (the body already read, nothing else arrives before that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
