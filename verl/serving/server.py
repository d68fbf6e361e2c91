"""Running an app under uvicorn: in the foreground (``python -m verl.serving``) or on a thread
(the review page of a training run, tests), with the bind rule checked first.

The bind rule: a loopback host (``127.0.0.1``, ``::1``, ``localhost``) needs nothing; any other
host (``0.0.0.0``, a LAN address) is reachable by others and needs an API key.
"""

from __future__ import annotations

import ipaddress
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["BackgroundServer", "check_bind", "is_loopback", "run"]

API_KEY_ENV = "VERL_SERVING_API_KEY"
"""Environment variable the command line reads the API key from (keys on a command line show in ``ps``)."""


def is_loopback(host: str) -> bool:
    """Whether ``host`` only accepts connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name other than localhost: may resolve anywhere
        return False


def check_bind(host: str, api_key: str | None) -> None:
    """ValueError when ``host`` is not a loopback address and no API key is set."""
    if not is_loopback(host) and not api_key:
        raise ValueError(
            f"binding to {host!r} makes the server reachable from other machines, which needs an API key: "
            f"set {API_KEY_ENV} (or pass api_key=), or bind to 127.0.0.1"
        )


def _config(app: Any, host: str, port: int) -> Any:
    import uvicorn

    return uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on", access_log=False)


def run(
    app: Any, *, host: str = "127.0.0.1", port: int = 8000, on_exit: Callable[[], None] | None = None
) -> None:
    """Serve ``app`` in the foreground until interrupted (checks the bind rule first).

    ``on_exit`` is called at SIGINT/SIGTERM, before uvicorn's own shutdown, which waits for every
    open request to be answered: a server whose requests can run long (the sandbox's) ends them there.
    """
    import uvicorn

    check_bind(host, getattr(app.state, "api_key", None))
    server = uvicorn.Server(_config(app, host, port))
    if on_exit is not None:
        handle_exit = server.handle_exit

        def _handle_exit(sig: int, frame: Any) -> None:
            on_exit()
            handle_exit(sig, frame)

        server.handle_exit = _handle_exit  # uvicorn installs it as the signal handler at run()
    server.run()


class BackgroundServer:
    """``app`` under uvicorn on a daemon thread; :meth:`stop` ends it. ``port=0`` picks a free port.

    Use as a context manager, or call :meth:`start` / :meth:`stop`.
    """

    def __init__(
        self, app: Any, *, host: str = "127.0.0.1", port: int = 0, start_timeout_s: float = 30.0
    ) -> None:
        import uvicorn

        check_bind(host, getattr(app.state, "api_key", None))
        self.host = host
        self._server = uvicorn.Server(_config(app, host, port))
        self._thread: threading.Thread | None = None
        self.start_timeout_s = start_timeout_s
        self.port: int | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise ValueError("the server is not started: call start() first")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self) -> "BackgroundServer":
        self._thread = threading.Thread(target=self._server.run, name="verl-serving-uvicorn", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + self.start_timeout_s
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError(
                    f"the server on {self.host} did not start (is the port taken? see the log above)"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server on {self.host} did not start within {self.start_timeout_s} s")
            time.sleep(0.02)
        sockets = [s for server in self._server.servers for s in server.sockets]
        self.port = int(sockets[0].getsockname()[1])
        logger.info("serving on %s", self.url)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._thread is None:
            return
        self._server.should_exit = True
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            self._server.force_exit = True
            self._thread.join(timeout_s)
        self._thread = None

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
