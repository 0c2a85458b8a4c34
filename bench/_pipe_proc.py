"""A byte pipe in the gateway's place, for bench/gateway.py's floor figure.

``_pipe_proc.py PORT SOCKET``: listens on the unix socket SOCKET and pipes every
connection's bytes to and from 127.0.0.1:PORT, on uvloop as the gateway is, with no
parsing, no policy and no record. What a proxy hop costs by itself: the gateway's
ratio over this one's is its own work. Prints ``ready`` once listening; runs until killed.
"""

from __future__ import annotations

import asyncio
import sys
from typing import cast

import uvloop


class _Up(asyncio.Protocol):
    def __init__(self, down: asyncio.Transport) -> None:
        self.down = down

    def data_received(self, data: bytes) -> None:
        self.down.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.down.close()


class _Down(asyncio.Protocol):
    def __init__(self, port: int) -> None:
        self.port = port
        self.up: asyncio.BaseTransport | None = None
        self.connecting: asyncio.Task[None] | None = None
        self.held: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # a stream socket (uvloop's)
        self.transport.pause_reading()
        self.connecting = asyncio.ensure_future(self._connect())

    async def _connect(self) -> None:
        up, _ = await asyncio.get_running_loop().create_connection(
            lambda: _Up(self.transport), "127.0.0.1", self.port)
        self.up = up
        if self.held:
            cast(asyncio.Transport, up).write(b"".join(self.held))
            self.held.clear()
        self.transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        if self.up is None:  # before the upstream connection is up: held until it is
            self.held.append(data)
            return
        cast(asyncio.Transport, self.up).write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.up is not None:
            self.up.close()


async def _serve(port: int, path: str) -> None:
    await asyncio.get_running_loop().create_unix_server(lambda: _Down(port), path)
    print("ready", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    uvloop.run(_serve(int(sys.argv[1]), sys.argv[2]))
