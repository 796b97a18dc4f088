"""The status page's questions to the services, as the callables :class:`~oncekit.status.collector.StatusCollector`
takes: end offsets from Kafka's admin API, the kit's prepared transactions from PostgreSQL, open
Kafka transactions from the broker's tool. Each opens what it needs per call and closes it, so a
restarted service is simply asked again at the next refresh. Errors never carry a password.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from confluent_kafka import KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, OffsetSpec  # type: ignore[attr-defined]

from oncekit.connectors.kafka import KafkaConfig, client_log
from oncekit.connectors.postgres import PreparedTransaction, connect, prepared_transaction_details
from oncekit.connectors.redact import redact_dsn
from oncekit.core.errors import ServiceError
from oncekit.status.kafka_transactions import KafkaTransaction, open_transactions
from oncekit.status.collector import EndOffsets, KafkaTransactionReader, PartitionOffsets, PreparedReader


# librdkafka's own lines (a broker restarting: "Connect ... failed") go to DEBUG: the page shows
# what failed from the call's error, once per refresh.
_CLIENT_LOG = client_log(__name__ + ".librdkafka")


def end_offsets(config: KafkaConfig, timeout_s: float = 10.0) -> EndOffsets:
    """Per partition: the end offset (high watermark) and the last stable offset, the end a
    read_committed reader (the kit's source) can reach; an open transaction holds the latter back."""
    admin = AdminClient(config.settings(logger=_CLIENT_LOG))  # one client for the collector's life

    def ask(wanted: Mapping[str, Sequence[int]]) -> PartitionOffsets:
        from confluent_kafka import IsolationLevel

        partitions = [TopicPartition(topic, p) for topic, ps in wanted.items() for p in ps]
        answers: dict[tuple[str, int], list[int | None]] = {(tp.topic, tp.partition): [None, None] for tp in partitions}
        for index, level in enumerate((IsolationLevel.READ_UNCOMMITTED, IsolationLevel.READ_COMMITTED)):
            latest = OffsetSpec.latest()  # type: ignore[no-untyped-call]
            futures = admin.list_offsets({tp: latest for tp in partitions}, isolation_level=level,
                                         request_timeout=timeout_s)
            for tp, future in futures.items():
                try:
                    answers[(tp.topic, tp.partition)][index] = int(future.result(timeout=timeout_s).offset)
                except KafkaException as exc:
                    raise ServiceError(f"kafka at {config.bootstrap_servers}: end offsets of {tp.topic}-{tp.partition}: "
                                       f"{exc.args[0]}") from exc
        return {key: (value[0], value[1]) for key, value in answers.items()}

    return ask


def prepared(dsn: str) -> PreparedReader:
    """The kit's prepared transactions in the DSN's database, with age and locks."""

    def ask() -> Sequence[PreparedTransaction]:
        import psycopg

        try:
            with connect(dsn, autocommit=True, connect_timeout=5) as conn:
                return prepared_transaction_details(conn)
        except psycopg.Error as exc:
            raise ServiceError(f"postgres at {redact_dsn(dsn)}: {redact_dsn(str(exc)).strip()}") from exc

    return ask


def kafka_transactions(config: KafkaConfig) -> KafkaTransactionReader:
    """Every open transaction in the cluster (any producer's: one on a topic the pipeline reads
    stalls it, one on an output topic stalls its readers)."""

    def ask() -> Sequence[KafkaTransaction]:
        return open_transactions(config.bootstrap_servers, dict(config.client))

    return ask


def collector_sources(kafka: KafkaConfig | str | None, dsn: str | None) -> dict[str, Any]:
    """Keyword arguments for :class:`~oncekit.status.collector.StatusCollector`: the real services
    that are given, Kafka as a configuration or its bootstrap servers (a missing one leaves that
    part of the page empty)."""
    out: dict[str, Any] = {}
    if isinstance(kafka, str):
        kafka = KafkaConfig(kafka) if kafka else None
    if kafka is not None:
        out["end_offsets"] = end_offsets(kafka)
        out["kafka_transactions"] = kafka_transactions(kafka)
    if dsn:
        out["prepared"] = prepared(dsn)
    return out
