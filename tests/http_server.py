"""An app served over a real socket on 127.0.0.1 (a free port) in a thread, for the tests."""

from __future__ import annotations

import contextlib
import threading
import time

import uvicorn


@contextlib.contextmanager
def running(app):
    """Yields the server's base URL ("http://127.0.0.1:PORT") while it serves `app`."""
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    for _ in range(400):
        if srv.started:
            break
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{srv.servers[0].sockets[0].getsockname()[1]}"
    finally:
        srv.should_exit = True
        thread.join(timeout=20)
