"""The client's connection: its request headers and body received under a time limit, the body under a size limit,
and its leaving noticed at once."""

from __future__ import annotations

import asyncio
import fcntl
import functools
import json
import logging
import re
import socket
import struct
import termios
from collections.abc import Callable
from http import HTTPStatus

import h11
from starlette.requests import ClientDisconnect, Request
from uvicorn.protocols.http.h11_impl import H11Protocol

from .requests import ApiError, shown


log = logging.getLogger("blockspec.server")


class ClientLeft(Exception):
    """The client closed its connection: there is nobody left to answer. The message says when."""


# How often a half-closed connection is checked for the reset that tells a client gone entirely
RESET_CHECK_S = 0.05
# How long a connection answered before its request body was all in reads and drops the rest before it closes: a
# socket closed with unread data sends a reset, which can reach the client before it has read the answer (a 413)
LINGER_S = 2.0
# How long a connection must have waited for its request before it may be closed to make room for a new one: one
# just opened (or just answered) may have its request on the way, which a close would reset unanswered
IDLE_BEFORE_CLOSE_S = 0.5
# How long a connection's client must have held up its request (not reading its answers, or not sending the rest
# of its body) before the connection may be closed to make room for a new one, where none is idle
STALLED_S = 1.0
# Bytes a second below which a request body that has been arriving for STALLED_S or more counts as held up too: a
# client trickling a byte now and then would otherwise keep its connection for --receive-timeout, and a few hundred
# such clients every other client out (a JSON body over any working link comes faster by orders of magnitude)
SLOW_BODY_BYTES_S = 1024
# Bytes held, at most, that arrive after a whole request while its answer is being made (the next pipelined
# request, or a stray line end): reading goes on meanwhile so that the client's leaving is seen at once
HELD_LIMIT = 65536
# Linux's TCP state of a connection whose peer sent its end of stream (tcp_info.tcpi_state)
TCP_CLOSE_WAIT = 8
# A body that arrives in more pieces than this (chunks, or reads of a Content-Length body), averaging under
# SMALL_PIECE bytes, is refused: the HTTP parser (pure Python) spends ~6 us on each, so a body sent in 1-byte
# chunks would hold the event loop, and every other client, for seconds; 32768 pieces cost ~0.2 s, and a JSON body
# streamed by json.JSONEncoder().iterencode comes in pieces of ~5 bytes (a 6 KB chat: 1213 of them)
MAX_SMALL_PIECES, SMALL_PIECE = 32768, 16
# Bytes of a request line and its headers (or of a chunked body's trailer section), at most: h11 refuses one past its
# buffer limit only while it is incomplete, so a larger one that arrives in one read would pass where the same one in
# two reads is refused; next_event applies the limit to both (431), and uvicorn gives it to h11 as its buffer limit
MAX_HEAD_BYTES = 16384


class LingeringTransport:
    """The connection's transport, whose close() lingers (TimedH11Protocol.linger) when the answer went out before
    the whole request body came in."""

    def __init__(self, transport, protocol: TimedH11Protocol):
        self._transport, self._protocol = transport, protocol

    def __getattr__(self, name):
        return getattr(self._transport, name)

    def write(self, data):
        if self._protocol.lingering is None:  # lingering, the connection's answer is out and its end sent
            self._transport.write(data)

    def resume_reading(self):
        protocol = self._protocol
        protocol.received_at = protocol.body_began = protocol.loop.time()  # the client may send again from now
        protocol.body_bytes = 0
        self._transport.resume_reading()

    def close(self):
        protocol = self._protocol
        if protocol.lingering is not None:
            return  # the client's end of stream or the linger's time closes it
        if protocol.cycle is not None and protocol.conn.their_state is h11.SEND_BODY:
            protocol.linger()
        else:
            self._transport.close()


class TimedH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 connection, closed when a request's headers are not all there receive_timeout_s after the
    connection opened or the previous response ended (answered 408 where part of them came): uvicorn alone waits
    forever for a first request, and for one sent a byte at a time. A client that half-closes the connection after
    its whole request still gets the answer (uvicorn alone drops it), and one that leaves after sending more than
    its request is noticed as one that left (data_received). A request it cannot parse is answered in JSON, as every
    other bad request. At most max_connections stay open (make_room), and one answered before its body was all in
    closes lingering (linger)."""

    def __init__(self, *args, receive_timeout_s: float, max_connections: int, max_body_bytes: int | None = None,
                 **kwargs):
        super().__init__(*args, **kwargs)
        self.receive_timeout_s, self.max_connections = receive_timeout_s, max_connections
        self.max_body_bytes = max_body_bytes  # a chunked body declaring more is refused at its chunk's size line
        self.request_deadline: asyncio.TimerHandle | None = None
        self.half_closed = None  # the cycle whose client sent its end of stream
        self.idle_since = 0.0  # when the connection last began waiting for a request
        self.lingering = None  # the timer of a lingering close (LingeringTransport)
        self.held = None  # bytes after a whole request whose answer is not out yet (data_received), or None
        self.pieces = self.piece_bytes = 0  # of the request's body so far (count_pieces)
        self.received_at = 0.0  # when bytes last came in
        self.body_began, self.body_bytes = 0.0, 0  # since when its body has been read, and its bytes since then
        self.write_paused_at = None  # since when the client has read none of its answers (writing paused), or None
        self.write_buffered = 0  # the bytes the client had not read then (unread)
        self.refusal = None  # (status, message, code) of a request refused by next_event

    def connection_made(self, transport):
        self.raw_transport = transport
        super().connection_made(LingeringTransport(transport, self))
        self.conn.next_event = functools.partial(self.next_event, self.conn.next_event)
        self.expect_request()
        if len(self.connections) > self.max_connections and not self.make_room():
            self.refuse(503, "too many open connections, each with a request in progress; retry later",
                        "too_many_connections", retry_after_s=1)

    def idle(self) -> bool:
        """No request in progress: none began since the connection opened or the last answer ended, at least
        IDLE_BEFORE_CLOSE_S ago."""
        return ((self.cycle is None or self.cycle.response_complete) and self.lingering is None
                and not self.transport.is_closing() and self.loop.time() - self.idle_since >= IDLE_BEFORE_CLOSE_S)

    def make_room(self) -> bool:
        """Past --max-connections, a lingering connection (answered, linger) closes, else the one idle the longest
        (IDLE_BEFORE_CLOSE_S at least: a newer one may have its request on the way), else the one whose client has
        held up its request the longest (stalled_since: not reading its answers, closed at once; or not sending its
        body, answered 408), so that a flood of idle or stalled connections (each of them open until
        --receive-timeout, or for good where their answers are not read) neither exhausts the process's files nor
        holds a new client back; False where every other connection has a request making progress."""
        others = [c for c in self.connections if c is not self]
        lingering = [c for c in others if c.lingering is not None]
        if lingering:
            lingering[0].raw_transport.close()
            return True
        idle = [c for c in others if c.idle()]
        if idle:
            min(idle, key=lambda c: c.idle_since).transport.close()
            return True
        stalled = [(since, c) for c in others if (since := c.stalled_since()) is not None]
        if not stalled:
            return False
        _, longest = min(stalled, key=lambda pair: pair[0])
        if longest.write_paused_at is not None:  # its answers are not read: they would never drain, nor a close
            longest.raw_transport.abort()
        else:
            longest.refuse(408, f"the request body stopped arriving for {STALLED_S:g} s or more, or came slower than "
                           f"{SLOW_BODY_BYTES_S} bytes a second, while the server had no room for new connections",
                           "body_timeout")
        return True

    def stalled_since(self) -> float | None:
        """Since when this connection's client has held up its request for STALLED_S or more (not reading its
        answers, or not sending the rest of its body, or sending it slower than SLOW_BODY_BYTES_S), or None."""
        now = self.loop.time()
        if self.lingering is not None or self.transport.is_closing():
            return None
        if self.write_paused_at is not None:
            unread = self.unread()
            if unread < self.write_buffered:  # the client reads, however slowly: a stall counts from now
                self.write_paused_at, self.write_buffered = now, unread
            since = self.write_paused_at
        elif (self.cycle is not None and self.conn.their_state is h11.SEND_BODY and not self.flow.read_paused
              and not self.cycle.waiting_for_100_continue):
            since = self.received_at  # (or when reading resumed: a body waiting to be read is not the client's stall)
            arriving = now - self.body_began
            if arriving >= STALLED_S and self.body_bytes < SLOW_BODY_BYTES_S * arriving:  # a trickle
                since = min(since, self.body_began)
        else:
            return None
        return since if now - since >= STALLED_S else None

    def unread(self) -> int:
        """Bytes written that the client has not read: the transport's buffer and the socket's send queue (Linux's
        SIOCOUTQ; the socket only takes more once much of it has gone, so the buffer alone stays still for seconds
        under a slow but steady reader)."""
        try:
            queued = struct.unpack("i", fcntl.ioctl(self.raw_transport.get_extra_info("socket").fileno(),
                                                    termios.TIOCOUTQ, b"\0" * 4))[0]
        except (OSError, AttributeError):
            queued = 0
        return self.raw_transport.get_write_buffer_size() + queued

    def pause_writing(self) -> None:
        self.write_paused_at, self.write_buffered = self.loop.time(), self.unread()
        super().pause_writing()

    def resume_writing(self) -> None:
        self.write_paused_at = None
        super().resume_writing()

    def refuse(self, status: int, message: str, code: str, retry_after_s: int | None = None) -> None:
        """Answer with an OpenAI-style JSON error and close: for what is refused before the app sees a request (with
        a Retry-After header where a retry may succeed). The log gets one line naming the client and the answer, as
        an access line would."""
        client = "%s:%d" % self.client[:2] if self.client else "-"
        log.info("%s - refused: %d %s", client, status, message)
        body = json.dumps(ApiError(status, message, code=code,
                                   type_="invalid_request_error" if status < 500 else "server_error").body()).encode()
        retry = f"retry-after: {retry_after_s}\r\n" if retry_after_s is not None else ""
        head = (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\n{retry}connection: close\r\n\r\n").encode()
        self.raw_transport.write(head + body)
        if self.cycle is not None and not self.cycle.response_complete:  # the app's request ends as one whose
            self.cycle.disconnected = True                              # client left: it writes nothing more
            self.cycle.message_event.set()
        self.linger()

    def linger(self) -> None:
        """Close once the client has sent what it was sending: the answer's end goes out (write_eof), what arrives
        is dropped until the client's end of stream or LINGER_S. A socket closed with unread data sends a reset,
        which can reach the client before it has read the answer (a 413 to a body still coming)."""
        transport = self.raw_transport
        if transport.is_closing():
            return
        if sum(c.lingering is not None for c in self.connections) >= self.max_connections:
            transport.close()  # lingering connections hold files too: at most max_connections of them
            return
        try:
            transport.write_eof()  # can_write_eof() is true for TCP; the client may be gone already
        except OSError:
            transport.close()
            return
        transport.resume_reading()
        self.lingering = self.loop.call_later(LINGER_S, transport.close)

    def _unsupported_upgrade_warning(self) -> None:
        """A request to upgrade the connection (to a WebSocket) is answered as plain HTTP (RFC 9110 7.8: the server
        may ignore Upgrade) without uvicorn's two warnings a request, one of them advice to install a library."""

    def next_event(self, h11_next_event):
        """h11's next event, with empty lines before a request line dropped (RFC 9112 2.2; h11 refuses them), a
        target in absolute form made the origin form (origin_form), and the refusals of count_pieces, of an HTTP
        version other than 1.x (505), of a target neither a path nor a URL (400), of a head or trailer section past
        MAX_HEAD_BYTES (by the bytes it took) and of a body past max_body_bytes, counting what a chunk's size line
        declares (413). h11's refusal of a request (h11.RemoteProtocolError, which uvicorn answers by
        send_400_response with a message of its own) keeps h11's reason for the answer."""
        buffer = self.conn._receive_buffer  # h11's unparsed input: no public call drops bytes of it or counts them
        in_head = self.conn.their_state is h11.IDLE
        if in_head:
            start = bytes(buffer._data[:256])
            if blank := len(start) - len(start.lstrip(b"\r\n")):
                buffer._extract(blank)
        before = len(buffer)
        try:
            event = h11_next_event()
        except h11.RemoteProtocolError as exc:
            if self.refusal is None:
                self.refusal = self.too_large(in_head) if exc.error_status_hint == 431 else \
                    (exc.error_status_hint, f"malformed HTTP request: {str(exc)[:200]}", "malformed_http")
            raise
        if type(event) in (h11.Request, h11.EndOfMessage) and before - len(buffer) > MAX_HEAD_BYTES:
            self.refusal = self.too_large(type(event) is h11.Request)
            raise h11.RemoteProtocolError(self.refusal[1], error_status_hint=431)
        if type(event) is h11.Request:
            if not event.http_version.startswith(b"1."):  # h11 takes any digit.digit, and would answer as 1.1
                version = event.http_version.decode("ascii")
                self.refusal = (505, f"HTTP/{version} is not supported; send HTTP/1.1 requests",
                                "http_version_not_supported")
                raise h11.RemoteProtocolError(self.refusal[1], error_status_hint=505)
            event = origin_form(event)
            if not event.target.startswith(b"/") and event.target != b"*":  # RFC 9112 3.2: a path or a URL
                target = event.target.decode("ascii", "replace")
                self.refusal = (400, f"malformed HTTP request: the request target {shown(target)} is neither a path "
                                "(/...) nor an absolute URL", "malformed_http")
                raise h11.RemoteProtocolError(self.refusal[1], error_status_hint=400)
        event = self.count_pieces(event)
        # a chunk's size line declares its bytes (h11 keeps the rest it awaits): past the limit, refused at once
        coming = getattr(self.conn._reader, "_bytes_in_chunk", 0) if self.conn.their_state is h11.SEND_BODY else 0
        if self.max_body_bytes is not None and self.piece_bytes + coming > self.max_body_bytes:
            error = body_too_large(self.max_body_bytes)
            self.refusal = (error.status, error.message, error.code)
            raise h11.RemoteProtocolError(error.message, error_status_hint=413)
        return event

    @staticmethod
    def too_large(head: bool) -> tuple[int, str, str]:
        what = "the request line and headers are" if head else "a chunked body's chunk line or trailer section is"
        return 431, f"{what} larger than the server's limit of {MAX_HEAD_BYTES} bytes", "headers_too_large"

    def count_pieces(self, event):
        """h11's next event, counted: past MAX_SMALL_PIECES pieces of a body averaging under SMALL_PIECE bytes, the
        request is refused as malformed (h11.RemoteProtocolError, which uvicorn answers by send_400_response)."""
        if type(event) is h11.Data:
            self.pieces, self.piece_bytes = self.pieces + 1, self.piece_bytes + len(event.data)
            self.body_bytes += len(event.data)
            if self.pieces > MAX_SMALL_PIECES and self.piece_bytes < SMALL_PIECE * self.pieces:
                self.refusal = (400, f"malformed HTTP request: the body came in more than {MAX_SMALL_PIECES} "
                                f"pieces of {self.piece_bytes / self.pieces:.0f} bytes on average; send it in chunks "
                                f"of at least {SMALL_PIECE} bytes, or with a Content-Length", "malformed_http")
                raise h11.RemoteProtocolError(self.refusal[1])
        elif type(event) is h11.Request:
            self.pieces = self.piece_bytes = 0
            # its body is awaited from now (a pipelined one's headers came earlier)
            self.received_at = self.body_began = self.loop.time()
            self.body_bytes = 0
        return event

    def send_400_response(self, msg: str) -> None:
        """A request the HTTP layer cannot parse (its framing or headers) answered as every other bad request, with
        an OpenAI-style JSON body naming h11's reason (uvicorn's own answer is plain text, and names none): 400, 431
        for a head past MAX_HEAD_BYTES, 501 for a transfer coding other than chunked; then the connection closed."""
        self.refuse(*(self.refusal or (400, f"malformed HTTP request: {msg}", "malformed_http")))

    def data_received(self, data: bytes) -> None:
        """As uvicorn, but for what arrives after a whole request while its answer is being made: uvicorn leaves
        it in h11's buffer and stops reading, so that a client that then leaves goes unnoticed and its generation
        runs to the end. Here reading goes on, what arrives is held (HELD_LIMIT at most) for h11 until the answer
        is out, and the client's end of stream reaches eof_received."""
        if self.lingering is not None:
            return
        self.received_at = self.loop.time()
        cycle = self.cycle
        answering = cycle is not None and not cycle.response_complete
        if answering and self.conn.their_state is h11.MUST_CLOSE:
            return  # after a request that closes the connection (Connection: close, HTTP/1.0) nothing is read
        if answering and self.conn.their_state is h11.DONE and self.held is None:
            self.held = bytearray()  # after a whole request: held before h11 sees it (below)
        if self.held is not None:
            self.held += data
            if len(self.held) > HELD_LIMIT and self.raw_transport.is_reading():
                self.raw_transport.pause_reading()
                self.loop.call_later(RESET_CHECK_S, self.watch_paused, cycle)
            return
        super().data_received(data)
        cycle = self.cycle
        if (self.flow.read_paused and cycle is not None and not cycle.response_complete
                and self.conn.their_state in (h11.DONE, h11.MUST_CLOSE)):  # h11 paused: the request is whole
            self.held = bytearray()
            self.raw_transport.resume_reading()

    def watch_paused(self, cycle):
        """While reading is paused (HELD_LIMIT bytes held) the client's end of stream or reset waits behind the unread
        bytes, where asyncio does not see it: the socket's own state shows it, a reset (the connection aborted: the
        client left) or an end of stream (TCP state CLOSE_WAIT, on Linux: then as eof_received)."""
        transport = self.raw_transport
        if cycle.response_complete or transport.is_closing() or self.held is None:
            return
        sock = transport.get_extra_info("socket")
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
            transport.abort()
        elif hasattr(socket, "TCP_INFO") and \
                sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] == TCP_CLOSE_WAIT:
            self.eof_received()  # seen early (eof_received takes each request's end of stream once)
        else:
            self.loop.call_later(RESET_CHECK_S, self.watch_paused, cycle)

    def on_response_complete(self):
        if self.held is not None:  # h11 takes what came after the request, as it would have read it
            held, self.held = bytes(self.held), None
            self.raw_transport.resume_reading()  # where HELD_LIMIT paused it; h11 may pause it again
            if held:  # (h11 takes empty data for the end of stream)
                self.conn.receive_data(held)
        super().on_response_complete()
        self.expect_request()
        if self.half_closed is not None and self.cycle.response_complete:  # no pipelined request began: the
            self.transport.close()                                         # client sends no more

    def expect_request(self):
        self.idle_since = self.loop.time()
        if self.request_deadline is not None:
            self.request_deadline.cancel()
        self.request_deadline = self.loop.call_later(self.receive_timeout_s, self.close_unless_requested, self.cycle)

    def close_unless_requested(self, cycle_before):
        # idle: no request began since, and the one before (if any) is answered; a pipelined request that began
        # inside on_response_complete is running, and re-arms the timer when its own answer ends
        idle = self.cycle is cycle_before and (cycle_before is None or cycle_before.response_complete)
        if not idle or self.transport.is_closing():
            return
        if bytes(self.conn._receive_buffer).strip(b"\r\n"):  # a request line or headers came, not all of them
            self.refuse(408, f"the request line and headers did not all arrive within {self.receive_timeout_s:g} s "
                        "(--receive-timeout)", "request_timeout")
        else:
            self.transport.close()

    def eof_received(self):
        """The client sent its end of stream. Once a whole request is in, the connection stays open for its
        answer and those of the requests pipelined behind it (then closes), as the client may only have shut its
        sending side (shutdown(SHUT_WR): `nc -N`, some proxies); before that, or idle, it closes as a client that
        left. A client that closed its socket entirely sends the same end of stream, but its machine answers any
        data with a reset: an interim '100 Continue' (which HTTP/1.1 clients skip, RFC 9110 15.2) is sent at once,
        and a reset seen on the socket ends the connection as a client that left, so that its generation stops."""
        cycle = self.cycle
        if (self.lingering is not None or cycle is None or cycle.response_complete
                or self.conn.their_state not in (h11.DONE, h11.MUST_CLOSE, h11.MIGHT_SWITCH_PROTOCOL)):
            return None  # asyncio closes the transport: connection_lost
        if cycle is not self.half_closed:  # the first end of stream of this request (reading resumed sees it again)
            self.half_closed = cycle
            # requests pipelined behind this one are answered in turn (on_response_complete closes after the last)
            cycle.keep_alive = bool(self.held or self.conn.trailing_data[0])
            # an HTTP/1.0 client takes no interim answer (RFC 9110 15.2): one that left is found at the first write
            if not cycle.response_started and cycle.scope["http_version"] == "1.1":
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
        if self.lingering is not None:
            self.lingering.cancel()
        super().connection_lost(exc)


def origin_form(request: h11.Request) -> h11.Request:
    """A request whose target is in absolute form (`GET http://host:port/path`), which a server must accept (RFC
    9112 3.2.2), as the origin form the app routes (`/path`), with the target's authority as its Host (the RFC has
    it replace the Host header); any other request as it came."""
    absolute = re.fullmatch(rb"(?i)https?://(?:[^/?#@]*@)?([^/?#]*)([^#]*)(?:#.*)?", request.target)
    if absolute is None:
        return request
    authority, path = absolute.groups()
    target = path if path.startswith(b"/") else b"/" + path
    headers = [(name, value) for name, value in request.headers.raw_items() if name.lower() != b"host"]
    return h11.Request(method=request.method, target=target, headers=[(b"host", authority), *headers],
                       http_version=request.http_version)


def shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down; retry on another instance or after it restarts",
                    type_="server_error", code="shutting_down")


def check_unencoded(request: Request) -> None:
    """ApiError 415 for a body sent under a Content-Encoding (gzip, ...): the server reads bodies as sent, and such a
    body would be refused as text that is not UTF-8."""
    encoding = request.headers.get("content-encoding", "").strip()
    if encoding.lower() not in ("", "identity"):
        raise ApiError(415, f"the request body is sent with Content-Encoding {shown(encoding)}; send it unencoded",
                       code="unsupported_content_encoding")


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


def body_too_large(max_bytes: int) -> ApiError:
    return ApiError(413, f"the request body is larger than the server's limit of {max_bytes} bytes (--max-body-mb)",
                    code="body_too_large")


async def read_body(request: Request, max_bytes: int, timeout_s: float, closing: asyncio.Event,
                    hold: Callable[[int], None] | None = None) -> bytes:
    """The whole body, or ApiError 413 (larger than max_bytes: refused from its Content-Length before any of it is
    read), 408 (not all there within timeout_s), 503 (the server began shutting down), or ClientLeft. hold(n) is
    called with each chunk's size as it arrives (it may refuse the body by raising ApiError)."""
    too_large = body_too_large(max_bytes)
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
