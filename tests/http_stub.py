"""A real HTTP server on loopback whose every answer a test scripts: for the seam between the
engine client and an engine (an answer, a connection closed or reset under a request, a
request held past its timeout), where a real engine cannot be made to misbehave on cue; and
the engine of bench/engine_client.py, which answers at once so that the client's cost is seen alone."""

from __future__ import annotations

import asyncio
import json
import socket
import struct


async def serve(behave) -> asyncio.Server:
    """A real HTTP server on loopback, each request read whole and then handled by
    ``behave(body, writer)``: it answers, closes the connection, resets it, or holds it."""
    async def handle(reader, writer):
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:"))
                if not await behave(json.loads(await reader.readexactly(length)), writer):
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0, backlog=4096)  # hundreds may connect at once (bench/engine_client.py)


def reply(writer, body: dict) -> bool:
    raw = json.dumps(body).encode()
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(raw), raw))
    return True


def close(writer, reset: bool) -> bool:
    if reset:  # an RST, not a FIN: the peer's read fails with ECONNRESET
        writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.close()
    return False


def url(server: asyncio.Server) -> str:
    return f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
