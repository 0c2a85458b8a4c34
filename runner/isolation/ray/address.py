"""The form of a Ray cluster address, checked before anything is asked of Ray.

A mistyped address is the operator's input error (exit 3, naming the flag or the cycle
file's field), not a cluster that could not be found (exit 5): Ray itself would try to
resolve it and answer "Invalid address format" or an ``int()`` error. Stdlib only: the
cycle file's schema uses it without loading Ray.
"""

from __future__ import annotations

ADDRESS_FIX = ("give HOST:PORT of the cluster's head (the GCS port, 6379 unless changed), "
               "'auto', or ray://HOST:PORT for Ray Client")
ADDRESS_MAX = 1024


def address_problem(address: str) -> str | None:
    """What is wrong with ``address`` as a Ray cluster address; None when it has the form
    Ray accepts (``auto``, ``ray://...`` (left to Ray Client), or ``HOST:PORT`` with an
    IPv6 host in brackets and a port from 1 to 65535)."""
    if not address.strip():
        return "empty Ray address"
    if len(address) > ADDRESS_MAX:
        return f"Ray address longer than {ADDRESS_MAX} characters"
    if any(not c.isprintable() or c.isspace() for c in address):
        return f"Ray address {address!r} holds a space or control character"
    if address == "auto" or address.startswith("ray://"):
        return None
    if "://" in address:
        return f"Ray address {address!r} is a URL, not HOST:PORT (only ray:// is taken)"
    host, colon, port = address.rpartition(":")
    if not colon or not host:
        return f"Ray address {address!r} is not HOST:PORT"
    if host.startswith("["):
        if not host.endswith("]") or len(host) < 3:
            return f"Ray address {address!r}: an IPv6 host goes in brackets, [HOST]:PORT"
    elif ":" in host or "[" in host or "]" in host or "/" in host:
        return f"Ray address {address!r} is not HOST:PORT (an IPv6 host goes in brackets)"
    if not (port.isascii() and port.isdigit()) or not 1 <= int(port) <= 65535:
        return f"Ray address {address!r}: port {port!r} is not a number from 1 to 65535"
    return None
