"""A bound on what each connection holds unsent (--max-unsent-bytes).

Why: the server learns that a client stopped reading only when its writes block, and on
Linux a connection's send buffer grows by itself to megabytes (4 MB measured on loopback),
so a stalled SSE client would absorb ~20,000 chunks before its stream noticed anything
(the stalled-reader pause in engine/async_engine.py).  With TCP_NOTSENT_LOWAT the socket
stops taking data once that many bytes wait unsent, while the bytes already in flight stay
unlimited -- so, unlike a small SO_SNDBUF, it costs a fast client on a long link nothing.
The transport's own write buffer (asyncio's default: 64 KiB before a write waits) gets the
same bound.  What a stalled client can then still absorb is its own receive buffer plus
twice the bound: measured on loopback with 16 KiB, 174 KB for a default Linux client
(4.1 MB without either bound), 36 KB for one with a 4 KiB receive buffer.

Set per accepted connection, by wrapping uvicorn's HTTP protocol class, so it holds for
every listener uvicorn creates (host/port, --fd, sockets handed over) without a race.
"""

from __future__ import annotations

import logging
import socket
from typing import Any

logger = logging.getLogger("tokenloom.server")

_TCP_NOTSENT_LOWAT = getattr(socket, "TCP_NOTSENT_LOWAT", None)  # Linux and macOS


def bound_unsent_bytes(sock: Any, nbytes: int) -> bool:
    """Set TCP_NOTSENT_LOWAT on one TCP socket; False where it does not apply (not TCP,
    no such option on this platform, nbytes 0)."""
    if not nbytes or _TCP_NOTSENT_LOWAT is None or sock is None:
        return False
    if getattr(sock, "family", None) not in (socket.AF_INET, socket.AF_INET6):
        return False
    try:
        sock.setsockopt(socket.IPPROTO_TCP, _TCP_NOTSENT_LOWAT, nbytes)
    except OSError as e:  # e.g. a kernel without it: the stall pause still works, later
        logger.debug("TCP_NOTSENT_LOWAT not set: %s", e)
        return False
    return True


def with_unsent_bound(protocol_class: type, nbytes: int) -> type:
    """`protocol_class` (uvicorn's h11 or httptools protocol) with every new connection's
    unsent bytes bounded by `nbytes`, in the kernel and in the transport's write buffer;
    the class itself when nbytes is 0."""
    if not nbytes or getattr(protocol_class, "_tokenloom_unsent_bound", None) == nbytes:
        return protocol_class

    def connection_made(self: Any, transport: Any) -> None:
        bound_unsent_bytes(transport.get_extra_info("socket"), nbytes)
        transport.set_write_buffer_limits(high=nbytes)  # uvicorn's writes wait above this
        protocol_class.connection_made(self, transport)

    return type(f"UnsentBounded{protocol_class.__name__}", (protocol_class,),
                {"connection_made": connection_made, "_tokenloom_unsent_bound": nbytes})
