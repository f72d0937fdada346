"""uvicorn with a drain: the first SIGTERM / Ctrl-C stops admitting (new requests get a 503 while
the port stays open, so a client learns why instead of meeting a refused connection), lets what
runs finish within the shutdown timeout, cuts the rest (their clients get a 503 error), then
runs uvicorn's own shutdown; the process exits 0. A second signal cuts what runs at once (with
the same 503), a third leaves without waiting for anything.

uvicorn re-raises a caught signal after its shutdown (to honour the default action), which would
end the process with 143 / KeyboardInterrupt; a drained shutdown is a clean exit, so the signal
is not handed back.
"""

from __future__ import annotations

import asyncio
import signal
import threading

import uvicorn


class DrainingServer(uvicorn.Server):
    """`uvicorn.Server` whose exit signal first drains `service` (`Service.drain`)."""

    def __init__(self, config: uvicorn.Config, service):
        super().__init__(config)
        self.service = service
        self._loop: asyncio.AbstractEventLoop | None = None
        self._requests = 0  # shutdown requests so far
        self._tasks: list[asyncio.Task] = []

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig, frame) -> None:
        """The signal handler (main thread)."""
        self.request_shutdown()

    def request_shutdown(self) -> None:
        """Drain, then stop; a second call cuts what runs now; a third exits at once. Callable
        from any thread."""
        self._requests += 1
        if self._loop is None or self._requests > 2:
            self.force_exit = self._requests > 2
            self.should_exit = True
            return
        timeout = None if self._requests == 1 else 0.0  # None: the service's --shutdown-timeout
        try:
            self._loop.call_soon_threadsafe(self._start_drain, timeout)
        except RuntimeError:  # the loop has already closed: nothing left to drain
            self.should_exit = True

    def _start_drain(self, timeout: float | None) -> None:
        async def drain_then_exit():
            try:
                await self.service.drain(timeout)
            finally:
                self.should_exit = True

        self._tasks.append(asyncio.ensure_future(drain_then_exit()))


def serve(app, service, *, host: str, port: int, log_level: str = "info") -> int:
    """Run until a signal drains and stops the server: the engine on this (the main) thread, where
    torch's kernels run at full speed (`engine.py`), uvicorn's event loop in a thread of its own;
    SIGTERM / SIGINT are taken here and handed to the server's drain. Returns 0 after a drained
    shutdown, 1 when the HTTP server ended by itself (e.g. the port was taken)."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                            timeout_graceful_shutdown=5)
    server = DrainingServer(config, service)
    engine = service.engine
    engine.foreground = True  # the app's lifespan must not start a second engine thread
    asked = []

    def http() -> None:
        try:
            server.run()
        finally:
            engine.stop(0)  # whatever ended the server ends the engine's loop on the main thread

    def on_signal(sig, frame) -> None:
        asked.append(sig)
        server.request_shutdown()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    thread = threading.Thread(target=http, name="selfspec-http", daemon=True)
    try:
        thread.start()
        engine.run_foreground()
        thread.join()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 0 if asked else 1
