"""User-facing errors: anything the user can fix (bad files, bad config, bad request).

The CLI prints these as one line and exits with code 2; the server answers them with HTTP 400.
"""


class BlockspecError(Exception):
    """A problem with the user's input, reported as one line without a traceback."""


class UnsupportedRequest(BlockspecError):
    """A request the selected decoding mode cannot serve exactly; it is refused, never served another way."""
