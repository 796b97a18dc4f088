"""The status page's web app and its server: ``/`` the page, ``/api/status`` its data as JSON,
``/metrics`` Prometheus' text format, ``/static/`` the page's script, style and uPlot.

Framework: Starlette served by uvicorn. Both are small, maintained and typed; Starlette's
routing, static files and JSON responses are all the page needs, prometheus_client's output is
returned as is, and uvicorn's ``Server`` runs on a thread beside a Spark driver (the pipeline
runner's ``--ui``) as well as in the foreground (``oncekit status``), with a clean stop in both.
No page data is computed per request: a refresh thread collects a snapshot every
``refresh_s`` and every request reads the newest one, so a slow service never slows the page and
many viewers cost nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from oncekit.status import metrics
from oncekit.status.collector import StatusCollector
from oncekit.status.snapshot import Snapshot

logger = logging.getLogger(__name__)

STATIC = Path(str(resources.files("oncekit.status") / "static"))


class StatusService:
    """Keeps the newest snapshot of ``collector``: refreshed every ``refresh_s`` on a daemon
    thread, with open Kafka transactions asked every ``kafka_transactions_every_s`` on a second
    one (each ask starts JVMs, which must not hold back the checkpoint figures). Started by
    :class:`StatusServer`; :meth:`latest` is safe from any thread."""

    def __init__(self, collector: StatusCollector, refresh_s: float = 2.0, kafka_transactions_every_s: float = 10.0) -> None:
        self.collector, self.refresh_s, self.kafka_every_s = collector, refresh_s, kafka_transactions_every_s
        self._latest: Snapshot | None = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def latest(self) -> Snapshot | None:
        return self._latest

    def refresh(self, ask_kafka_transactions: bool = True) -> Snapshot:
        self._latest = self.collector.collect(ask_kafka_transactions)
        return self._latest

    def start(self) -> None:
        self.refresh(ask_kafka_transactions=False)
        self._threads = [
            threading.Thread(target=self._every, args=(self.refresh_s, lambda: self.refresh(False)),
                             name="oncekit-status-refresh", daemon=True),
            threading.Thread(target=self._every, args=(self.kafka_every_s, self.collector.ask_kafka_transactions, True),
                             name="oncekit-status-kafka-transactions", daemon=True)]
        for thread in self._threads:
            thread.start()

    def _every(self, period_s: float, work: Callable[[], object], now: bool = False) -> None:
        wait_s = 0.0 if now else period_s
        while not self._stop.wait(wait_s):
            wait_s = period_s
            try:
                work()
            except Exception as exc:  # the page shows the last good snapshot; try again next time
                logger.warning("status: refresh failed: %s", exc)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=30)


def create_app(service: StatusService) -> Starlette:
    """The ASGI app over ``service``'s snapshots."""
    registry = metrics.registry(service.latest)

    async def page(request: Request) -> Response:
        return FileResponse(STATIC / "index.html", media_type="text/html")

    async def status(request: Request) -> Response:
        snapshot = service.latest()
        return JSONResponse(snapshot.to_json() if snapshot is not None else {"taken_at": None},
                            headers={"Cache-Control": "no-store"})

    async def prometheus(request: Request) -> Response:
        return Response(metrics.render(registry), media_type="text/plain; version=0.0.4; charset=utf-8")

    return Starlette(routes=[
        Route("/", page),
        Route("/api/status", status),
        Route("/metrics", prometheus),
        Mount("/static", app=StaticFiles(directory=STATIC), name="static"),
    ])


class StatusServer:
    """The page on ``host:port`` (port 0: a free one, see :attr:`url`). :meth:`start` serves on a
    daemon thread and returns once the port is bound; :meth:`serve_forever` serves in the calling
    thread until Ctrl-C; :meth:`stop` ends either."""

    def __init__(self, service: StatusService, host: str = "127.0.0.1", port: int = 8765) -> None:
        self.service = service
        config = uvicorn.Config(create_app(service), host=host, port=port, log_level="warning", access_log=False,
                                lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None
        self.host, self.port = host, port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/"

    def _bound_port(self) -> int:
        for server in getattr(self._server, "servers", []):
            for sock in server.sockets:
                return int(sock.getsockname()[1])
        return self.port

    def start(self, timeout_s: float = 30.0) -> StatusServer:
        self.service.start()
        self._thread = threading.Thread(target=self._server.run, name="oncekit-status-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.service.stop()
                from oncekit.core.errors import ServiceError

                raise ServiceError(f"status page: could not serve on {self.host}:{self.port} (port in use?)")
            time.sleep(0.05)
        self.port = self._bound_port()
        return self

    def serve_forever(self) -> None:
        self.service.start()
        try:
            self._server.run()
        finally:
            self.service.stop()

    def stop(self) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.service.stop()

    def restarted(self, attempt: int, error: BaseException) -> None:
        """The runner's restart strategy restarted its queries (``on_restart`` of
        :func:`~oncekit.core.restart.supervise`)."""
        self.service.collector.record_restart("*", error)

    def __enter__(self) -> StatusServer:
        return self if self._thread is not None else self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
