"""OpenAI-compatible HTTP server over one Engine: `blockspec serve`.

Endpoints: GET /health, GET /v1/models, POST /v1/chat/completions, POST /v1/completions (streamed as server-sent
events or not). The engine decodes one request at a time on a single worker thread; requests wait in a bounded queue
and are refused with HTTP 429 when it is full. Sampling fields a request leaves out take the server's defaults
(Engine.serving_defaults). A reply ends at its first stop string or stop token (models/text.py ReplyText). A request the
engine cannot serve exactly (n > 1, logprobs, penalties, images, ...) or that is malformed is refused with HTTP 400
naming the field, before it touches the engine. A client that goes away gives its place up at once and stops its
generation at the next token. Bodies are limited in size and time, parsed off the event loop; Host, Origin and an
optional API key are checked first; SIGTERM drains the server within a grace period (ServerSettings holds every
limit).
"""

from ..errors import BlockspecError

try:  # the server is an optional extra: check it here, before any submodule imports fastapi
    import uvicorn  # noqa: F401
    import fastapi  # noqa: F401
    import fastapi.responses  # noqa: F401
    import starlette.exceptions  # noqa: F401
except ImportError as _exc:
    raise BlockspecError(f"blockspec serve needs the 'serve' extras ({_exc.name} is not installed): "
                         "pip install 'blockspec[serve]'") from None

from .app import bind_socket, create_app, reserve_files, serve

__all__ = ["bind_socket", "create_app", "reserve_files", "serve"]
