"""uvicorn serving the app, with a shutdown that first gives every request its ending.

uvicorn's shutdown (Ctrl+C, SIGTERM) stops accepting connections, waits up to
`timeout_graceful_shutdown` for the open ones, cancels what is left, and only then runs the app's
lifespan shutdown, where the worker used to stop: a running stream was cut mid-chunk and a waiting
request got nothing. Here the shutdown starts with `Worker.begin_shutdown`: the running request
ends after its current step (a stream gets its last chunk and `[DONE]`, a plain request a 503),
the waiting ones fail with 503 at once, and the connections then close within the grace period.
"""

from __future__ import annotations

import errno
import socket

import uvicorn

from app.server.worker import Worker


class Server(uvicorn.Server):
    """uvicorn.Server that ends `worker`'s jobs before it waits on the open connections."""

    def __init__(self, config: uvicorn.Config, worker: Worker) -> None:
        super().__init__(config)
        self.worker = worker

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.worker.begin_shutdown()
        await super().shutdown(sockets)


def bind_problem(host: str, port: int) -> str | None:
    """Why `host`:`port` cannot be listened on (one line), or None: checked before the model loads,
    so that a port in use is known in a moment rather than after the load. The socket is closed
    again; uvicorn binds its own (with SO_REUSEADDR, as here)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as err:
        return f"--host {host!r} does not resolve ({err.strerror}); give an address of this machine"
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as err:
            fix = {errno.EADDRINUSE: "choose another --port, or stop the program that holds it",
                   errno.EADDRNOTAVAIL: "give --host an address of this machine",
                   errno.EACCES: "choose a --port above 1023, or run with the right to bind it"}
            advice = fix.get(err.errno, "choose another --host or --port")
            return f"cannot listen on {host}:{port}: {err.strerror}; {advice}"
    return None
