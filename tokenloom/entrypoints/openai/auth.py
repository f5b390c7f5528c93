"""The `Authorization: Bearer <key>` check shared by the API middleware and the dashboard."""

from __future__ import annotations

import hmac


def bearer_matches(header: bytes | str, key: str) -> bool:
    """Whether an Authorization header value carries `key` as a Bearer token.

    The scheme is matched in any case (RFC 7235 section 2.1: `bearer K` is `Bearer K`), with
    one or more spaces before the credentials; the key itself is compared in constant time, so
    its bytes cannot be guessed one by one from response times."""
    raw = header.encode("latin-1", "replace") if isinstance(header, str) else header
    scheme, _, credentials = raw.strip().partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(credentials.lstrip(b" "), key.encode())
