"""What ``oncekit status`` and the runners' ``--ui PORT`` call: one function each.

Addresses: ``--bootstrap`` / ``--dsn``, else ``ONCEKIT_KAFKA_BOOTSTRAP`` / ``ONCEKIT_POSTGRES_DSN``,
else the services ``oncekit services up`` started; without one, that part of the page stays
empty. The DSN is never printed.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from oncekit.connectors.kafka import KafkaConfig
from oncekit.connectors.services import service_addresses
from oncekit.core.errors import ConfigError
from oncekit.core.protocol import SinkConfig
from oncekit.status.app import StatusServer, StatusService
from oncekit.status.collector import StatusCollector, Watched
from oncekit.status.services import collector_sources
from oncekit.status.snapshot import Thresholds


def protocols_of(config: SinkConfig) -> dict[str, str]:
    """Sink id -> protocol of a sink configuration, with a fan-out's targets."""
    out = {config.sink_id: config.protocol}
    for target in getattr(config, "targets", {}).values():
        out.update(protocols_of(target))
    return out


def watched_from_flags(checkpoints: Sequence[str]) -> list[Watched]:
    """``NAME=LOCATION`` or ``LOCATION`` (named by its last path component) per checkpoint."""
    out = []
    for given in checkpoints:
        name, sep, location = given.partition("=")
        if not sep or "/" in name or ":" in name:
            name, location = given.rstrip("/").rsplit("/", 1)[-1] or given, given
        if "://" not in location and not location.startswith("file:"):
            location = str(Path(location).absolute())
        out.append(Watched(name, location))
    return out


def start_page(watched: Sequence[Watched], port: int, kafka: KafkaConfig | str | None, dsn: str | None,
               thresholds: Thresholds | None = None, host: str = "127.0.0.1", refresh_s: float = 2.0) -> StatusServer:
    """Serve the page on a thread (the runners' ``--ui``); the caller stops the returned server."""
    collector = StatusCollector(watched, thresholds, **collector_sources(kafka, dsn))
    return StatusServer(StatusService(collector, refresh_s), host, port).start()


def main(checkpoints: Sequence[str], port: int, host: str, bootstrap: str | None, dsn: str | None,
         thresholds: Thresholds, once: bool = False) -> int:
    """``oncekit status``: serve the page in the foreground until Ctrl-C, or with ``once`` print
    the metrics one snapshot gives and return."""
    if not checkpoints:
        raise ConfigError("status: give at least one --checkpoint (a query's checkpoint location)")
    bootstrap, dsn = service_addresses(bootstrap, dsn)
    collector = StatusCollector(watched_from_flags(checkpoints), thresholds, **collector_sources(bootstrap, dsn))
    service = StatusService(collector)
    if once:
        from oncekit.status import metrics

        service.refresh()
        sys.stdout.write(metrics.render(metrics.registry(service.latest)).decode())
        return 0
    server = StatusServer(service, host, port)
    print(f"status page: {server.url} (metrics at {server.url}metrics); Ctrl-C stops it", flush=True)
    server.serve_forever()
    return 0


def for_runner(name: str, checkpoint: str, sink: SinkConfig, port: int, bootstrap: str, dsn: str,
               extra: Mapping[str, str] | None = None) -> StatusServer:
    """The page of one running query, its protocols known from its sink (the runners' ``--ui``)."""
    protocols = {**protocols_of(sink), **(extra or {})}
    return start_page([Watched(name, checkpoint, protocols)], port, bootstrap, dsn)
