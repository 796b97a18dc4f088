"""The Kafka sink's configuration and its typed builder, :func:`kafka_sink`."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Literal, cast, get_args

from oncekit.connectors.kafka import KafkaConfig, refuse_java_client_settings
from oncekit.connectors.redact import redact_config
from oncekit.core.errors import ConfigError
from oncekit.core.protocol import Sink, SinkConfig
from oncekit.sinks.kafka._common import DEFAULT_TRANSACTION_TIMEOUT_MS, FORMAT
from oncekit.sinks.kafka.at_least_once import KafkaAtLeastOnceSink
from oncekit.sinks.kafka.transactional import KafkaTransactionalSink
from oncekit.sinks.kafka.write_ahead_log import KafkaWriteAheadSink

KafkaProtocol = Literal["transactional", "write-ahead-log", "at-least-once"]
PROTOCOLS: tuple[KafkaProtocol, ...] = get_args(KafkaProtocol)


@dataclass(frozen=True)
class KafkaSinkConfig(SinkConfig):
    """A Kafka sink. ``client`` holds librdkafka settings (security, SASL); secrets never reach
    ``repr`` or error text. ``partitions`` is used when the topic must be created."""

    format_name: ClassVar[str] = FORMAT

    bootstrap_servers: str
    topic: str
    protocol: KafkaProtocol = "transactional"
    sink_id: str = ""
    client: Mapping[str, str] = field(default_factory=dict)
    partitions: int = 2
    transaction_timeout_ms: int = DEFAULT_TRANSACTION_TIMEOUT_MS
    dead_letter_topic: str | None = None
    columns: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        self._check_common(PROTOCOLS, self.topic, f"kafka-{self.topic}")
        refuse_java_client_settings(self.client, f"{FORMAT} sink {self.sink_id}")
        if self.columns and "value" not in self.columns:
            raise ConfigError(f"{FORMAT} sink {self.sink_id}: the stream needs a value column; it has {', '.join(self.columns)}")

    def __repr__(self) -> str:
        return (f"KafkaSinkConfig(bootstrap_servers={self.bootstrap_servers!r}, topic={self.topic!r}, "
                f"protocol={self.protocol!r}, sink_id={self.sink_id!r}, client={redact_config(self.client)!r})")

    @functools.cached_property
    def kafka(self) -> KafkaConfig:
        """The cluster this sink writes to; made once (a sink is built from its config at every
        task and driver commit, and asks for it several times each)."""
        return KafkaConfig(self.bootstrap_servers, dict(self.client))

    def to_options(self) -> dict[str, str]:
        options = {"kafka.bootstrap.servers": self.bootstrap_servers, "topic": self.topic, "protocol": self.protocol,
                   "sinkid": self.sink_id, "partitions": str(self.partitions),
                   "transactiontimeoutms": str(self.transaction_timeout_ms)}
        options.update({f"kafka.{k}": v for k, v in self.client.items()})
        if self.dead_letter_topic:
            options["deadlettertopic"] = self.dead_letter_topic
        return options

    @classmethod
    def from_options(cls, options: Mapping[str, str], columns: tuple[str, ...]) -> KafkaSinkConfig:
        lowered = {k.lower(): v for k, v in options.items()}
        client = {k[len("kafka."):]: v for k, v in lowered.items() if k.startswith("kafka.")}
        bootstrap = client.pop("bootstrap.servers", "")
        if not bootstrap:
            raise ConfigError(f"{FORMAT}: option kafka.bootstrap.servers is required")
        return cls(
            bootstrap_servers=bootstrap, topic=lowered.get("topic", ""),
            protocol=cast(KafkaProtocol, lowered.get("protocol", "transactional")),  # checked in __post_init__
            sink_id=lowered.get("sinkid", ""), client=client, partitions=int(lowered.get("partitions", "2")),
            transaction_timeout_ms=int(lowered.get("transactiontimeoutms", DEFAULT_TRANSACTION_TIMEOUT_MS)),
            dead_letter_topic=lowered.get("deadlettertopic") or None, columns=columns,
        )

    @classmethod
    def data_source(cls) -> type:
        from oncekit.sinks.kafka._spark import KafkaSinkDataSource

        return KafkaSinkDataSource

    def build(self, checkpoint: str) -> Sink:
        if self.protocol == "transactional":
            return KafkaTransactionalSink(self)
        if self.protocol == "write-ahead-log":
            return KafkaWriteAheadSink(self, checkpoint)
        return KafkaAtLeastOnceSink(self)


def kafka_sink(bootstrap_servers: str, topic: str, protocol: KafkaProtocol = "transactional", *, sink_id: str = "",
               client: Mapping[str, str] | None = None, partitions: int = 2,
               transaction_timeout_ms: int = DEFAULT_TRANSACTION_TIMEOUT_MS, dead_letter_topic: str | None = None,
               columns: Sequence[str] = ()) -> KafkaSinkConfig:
    """A Kafka sink into ``topic``, for :func:`~oncekit.start_query`:
    ``kafka_sink("broker:9092", "balances", "transactional", client={"security.protocol": "SASL_SSL", ...})``.
    The stream needs a ``value`` column (string or binary); a ``key`` column is optional.

    :param bootstrap_servers: the brokers, ``host:port[,host:port...]``.
    :param topic: the target topic; created with ``partitions`` partitions when it does not exist.
    :param protocol: how output becomes visible exactly once (see the Protocols page):
        ``transactional`` (Kafka transactions per task, committed once the checkpoint completes),
        ``write-ahead-log`` (staged under the checkpoint, published by the driver), or ``at-least-once``.
    :param sink_id: names the sink's transactional ids, journal and marker topic; default
        ``kafka-<topic>``. Keep it across restarts: a new id is a new sink.
    :param client: librdkafka settings for every client of the sink (``security.protocol``,
        ``sasl.*``, ``ssl.*``), as confluent-kafka takes them; secrets never reach logs or reprs.
    :param partitions: the partition count of a topic the sink creates.
    :param transaction_timeout_ms: the broker's bound on an open transaction; a transaction open
        longer (a driver gone between a batch and its commit) is aborted by the broker.
    :param dead_letter_topic: a topic for records the broker refuses (too large, for one),
        instead of failing the task; None fails it with :class:`~oncekit.RecordError` naming the row.
    :param columns: the stream's columns; the stream writer fills them in, so a job leaves them out.
    """
    return KafkaSinkConfig(bootstrap_servers=bootstrap_servers, topic=topic, protocol=protocol, sink_id=sink_id,
                           client=dict(client or {}), partitions=partitions,
                           transaction_timeout_ms=transaction_timeout_ms, dead_letter_topic=dead_letter_topic,
                           columns=tuple(columns))
