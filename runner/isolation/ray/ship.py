"""Shipping an image from the head's engine to the nodes that lack it: the pure parts.

The head streams ``docker save`` of the image *by the id it resolved itself* into chunks
of :data:`CHUNK_BYTES`, puts each in the object store and feeds it to one loader per
missing node (:class:`runner.isolation.ray.node.ImageLoader`), with at most
:data:`WINDOW` chunks unacknowledged, so neither side nor the object store ever holds
more than a few chunks. A node writes the chunks to a temporary file under its node
directory (capped by :data:`MAX_IMAGE_BYTES` and :data:`MAX_CHUNKS`), streams it into
its engine's ``docker load``, removes the file, and answers only when the id the head
announced is now what the reference names there.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from runner.errors import PrerequisiteError

MiB = 1024 * 1024
CHUNK_BYTES = 32 * MiB
"""One object-store object (the tests' object store is 100 MiB per node)."""
READ_BYTES = 1 * MiB
"""How much of ``docker save`` the head reads at a time."""
MAX_IMAGE_BYTES = 8 * 1024 * MiB
"""Largest saved image the head sends and a node accepts."""
MAX_CHUNKS = MAX_IMAGE_BYTES // CHUNK_BYTES + 64
WINDOW = 2
"""Chunks in flight (put but not yet written by every loader)."""
CHUNK_TIMEOUT_S = 120.0
"""How long a node may take to receive and write one chunk (its loader's start included)."""
LOAD_TIMEOUT_S = 900.0
"""How long a node's ``docker load`` and check may take once every chunk arrived."""
ABORT_TIMEOUT_S = 10.0

Handle = TypeVar("Handle")


def rechunk(stream: Iterable[bytes], size: int = CHUNK_BYTES,
            cap: int = MAX_IMAGE_BYTES, *, what: str = "the image") -> Iterator[bytes]:
    """``stream``'s bytes again, in pieces of exactly ``size`` (the last may be
    shorter); PrerequisiteError once more than ``cap`` bytes came."""
    buf = bytearray()
    total = 0
    for piece in stream:
        total += len(piece)
        if total > cap:
            raise PrerequisiteError(f"{what} is larger than {cap} bytes, the most a node "
                                    "accepts. Fix: make the image smaller, or `docker "
                                    "load` it on each node by hand")
        buf += piece
        while len(buf) >= size:
            out = bytes(buf[:size])
            del buf[:size]
            yield out
    if buf:
        yield bytes(buf)


def pump(chunks: Iterable[bytes], put: Callable[[bytes], Any],
         send: Callable[[Any], Handle], settle: Callable[[Handle], None],
         window: int = WINDOW) -> tuple[int, int]:
    """Hand every chunk to the loaders: ``put`` it (the object store), ``send`` the
    stored object to every loader, and ``settle`` (wait for every loader to have written
    it) once ``window`` chunks are unsettled. No reference to a chunk outlives its
    settling, so the store holds at most ``window`` of them. Returns (chunks, bytes)."""
    if window < 1:
        raise ValueError("window must be at least 1")
    pending: deque[Handle] = deque()
    count = total = 0
    for data in chunks:
        count += 1
        total += len(data)
        ref = put(data)
        del data  # the store holds it now
        pending.append(send(ref))
        del ref
        while len(pending) >= window:
            settle(pending.popleft())
    while pending:
        settle(pending.popleft())
    return count, total


class Received:
    """What a node has accepted so far, against its caps."""

    def __init__(self, *, max_bytes: int = MAX_IMAGE_BYTES,
                 max_chunks: int = MAX_CHUNKS) -> None:
        self.max_bytes = max_bytes
        self.max_chunks = max_chunks
        self.bytes = 0
        self.chunks = 0

    def take(self, size: int) -> None:
        """Count one more chunk of ``size`` bytes; PrerequisiteError past a cap."""
        if self.chunks + 1 > self.max_chunks:
            raise PrerequisiteError(f"image transfer refused: more than {self.max_chunks} "
                                    "chunks")
        if self.bytes + size > self.max_bytes:
            raise PrerequisiteError(f"image transfer refused: more than {self.max_bytes} "
                                    "bytes")
        self.chunks += 1
        self.bytes += size
