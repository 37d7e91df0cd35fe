"""Routing with several replicas: the headers a proxy hashes on (x-session-id, x-cache-scope).

Plain functions over protobuf messages; client.py adds their results to each call.
"""

from __future__ import annotations

import urllib.parse

from google.protobuf.message import Message

# A generation call's non-empty session_id / cache_scope, repeated as headers so that a proxy can
# hash on them without parsing the body.
SESSION_ID_KEY = "x-session-id"
CACHE_SCOPE_KEY = "x-cache-scope"

_ROUTING_FIELDS = (("session_id", SESSION_ID_KEY), ("cache_scope", CACHE_SCOPE_KEY))
# Left as they are in a header value: printable ASCII but space and "%" (the escape character).
_HEADER_SAFE = "".join(chr(code) for code in range(0x21, 0x7F) if chr(code) != "%")


def routing_metadata(request: Message) -> tuple[tuple[str, str], ...]:
    """The `x-session-id` / `x-cache-scope` metadata of a request's non-empty session_id /
    cache_scope (none for a request without them). A header value must be printable ASCII, so
    other text is sent as its UTF-8, percent-encoded: the same value always gives the same
    header, and a call never fails for its session id."""
    fields = request.DESCRIPTOR.fields_by_name
    return tuple(
        (key, urllib.parse.quote(getattr(request, name), safe=_HEADER_SAFE))
        for name, key in _ROUTING_FIELDS
        if name in fields and getattr(request, name)
    )
