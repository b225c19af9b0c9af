"""The client's connection: its request headers and body received under a time limit, the body under a size limit,
and its leaving noticed at once."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Callable

import h11
from starlette.requests import ClientDisconnect, Request
from uvicorn.protocols.http.h11_impl import H11Protocol

from .requests import ApiError


class ClientLeft(Exception):
    """The client closed its connection: there is nobody left to answer. The message says when."""


# How often a half-closed connection is checked for the reset that tells a client gone entirely
RESET_CHECK_S = 0.05


class TimedH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 connection, closed when a request's headers are not all there receive_timeout_s after the
    connection opened or the previous response ended: uvicorn alone waits forever for a first request, and for one
    sent a byte at a time. A client that half-closes the connection after its whole request still gets the answer
    (uvicorn alone drops it). A request it cannot parse is answered in JSON, as every other bad request."""

    def __init__(self, *args, receive_timeout_s: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.receive_timeout_s = receive_timeout_s
        self.request_deadline: asyncio.TimerHandle | None = None
        self.half_closed = None  # the cycle whose client sent its end of stream

    def connection_made(self, transport):
        super().connection_made(transport)
        self.expect_request()

    def send_400_response(self, msg: str) -> None:
        """A request the HTTP layer cannot parse (its framing or headers) answered as every other bad request: 400
        with an OpenAI-style JSON body, then the connection closed (uvicorn's own answer is plain text)."""
        body = json.dumps(ApiError(400, f"malformed HTTP request: {msg}", code="malformed_http").body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                      h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()

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

    def eof_received(self):
        """The client sent its end of stream. Once a whole HTTP/1.1 request is in, the connection stays open for the
        answer (then closes), as the client may only have shut its sending side (shutdown(SHUT_WR): `nc -N`, some
        proxies); before that, or idle, it closes as a client that left. A client that closed its socket entirely
        sends the same end of stream, but its machine answers any data with a reset: an interim '100 Continue' (which
        HTTP/1.1 clients skip, RFC 9110 15.2) is sent at once, and a reset seen on the socket ends the connection as
        a client that left, so that its generation stops."""
        cycle = self.cycle
        if (cycle is None or cycle.response_complete or self.conn.their_state not in (h11.DONE, h11.MUST_CLOSE)
                or cycle.scope["http_version"] != "1.1"):
            return None  # asyncio closes the transport: connection_lost
        if cycle is not self.half_closed:  # the first end of stream of this request (reading resumed sees it again)
            self.half_closed, cycle.keep_alive = cycle, False
            if not cycle.response_started:
                interim = h11.InformationalResponse(status_code=100, headers=[], reason=b"Continue")
                self.transport.write(self.conn.send(interim))
            self.loop.call_later(RESET_CHECK_S, self.close_if_reset, cycle)
        return True

    def close_if_reset(self, cycle):
        if cycle.response_complete or self.transport.is_closing():
            return
        if self.transport.get_extra_info("socket").getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
            self.transport.abort()
        else:
            self.loop.call_later(RESET_CHECK_S, self.close_if_reset, cycle)

    def connection_lost(self, exc):
        self.request_deadline.cancel()
        super().connection_lost(exc)


def shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down; retry on another instance or after it restarts",
                    type_="server_error", code="shutting_down")


def declared_length(request: Request) -> int | None:
    """The body's length as its headers declare it: Content-Length's, or None where none is given (chunked). A
    request with both Content-Length and Transfer-Encoding is refused, 400: its length is ambiguous (RFC 9112 6.1),
    and the HTTP layer reads the chunks whatever Content-Length says, so that a large body would pass for a small
    one."""
    declared = request.headers.get("content-length", "")
    if "transfer-encoding" in request.headers:
        if declared:
            raise ApiError(400, "the request has both Content-Length and Transfer-Encoding headers, which leaves its "
                           "length ambiguous; send one of them", code="ambiguous_length")
        return None
    return int(declared) if declared.isdigit() else None


async def read_body(request: Request, max_bytes: int, timeout_s: float, closing: asyncio.Event,
                    hold: Callable[[int], None] | None = None) -> bytes:
    """The whole body, or ApiError 413 (larger than max_bytes: refused from its Content-Length before any of it is
    read), 408 (not all there within timeout_s), 503 (the server began shutting down), or ClientLeft. hold(n) is
    called with each chunk's size as it arrives (it may refuse the body by raising ApiError)."""
    too_large = ApiError(413, f"the request body is larger than the server's limit of {max_bytes} bytes "
                         "(--max-body-mb)", code="body_too_large")
    declared = declared_length(request)
    if declared is not None and declared > max_bytes:
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
