"""The PostgreSQL sink's configuration and its typed builder, :func:`postgres_sink`."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Literal, cast, get_args

from oncekit.connectors.redact import join_dsn_password, redact_dsn, split_dsn_password
from oncekit.core.errors import ConfigError
from oncekit.core.protocol import Sink, SinkConfig
from oncekit.sinks.postgres._common import FORMAT
from oncekit.sinks.postgres.at_least_once import PostgresAtLeastOnceSink
from oncekit.sinks.postgres.idempotent import PostgresIdempotentSink
from oncekit.sinks.postgres.two_phase_commit import PostgresTwoPhaseCommitSink
from oncekit.sinks.postgres.write_ahead_log import PostgresWriteAheadSink

PostgresProtocol = Literal["two-phase-commit", "write-ahead-log", "idempotent", "at-least-once"]
PROTOCOLS: tuple[PostgresProtocol, ...] = get_args(PostgresProtocol)


@dataclass(frozen=True)
class PostgresSinkConfig(SinkConfig):
    """A PostgreSQL sink. ``protocol`` picks the commit protocol:

    - ``two-phase-commit``: tasks PREPARE a transaction per partition; the driver COMMITs PREPARED
      once the checkpoint completes. Needs ``max_prepared_transactions`` > 0 on the server.
    - ``write-ahead-log``: tasks stage rows under the checkpoint; once it completes, one
      transaction writes them and records (sink, batch) in ``oncekit_checkpoints``.
    - ``idempotent``: tasks upsert by ``key_columns`` and commit at once.
    - ``at-least-once``: tasks append and commit at once; a replay duplicates rows.

    ``key_columns`` turn appends into merges: ``on_conflict="update"`` (upsert; the last row of
    a partition wins for a key) or ``"nothing"`` (append with a dedup key; the row written first
    stays). Rows with keys the target does not hold yet go in by plain COPY.
    """
    format_name: ClassVar[str] = FORMAT

    dsn: str = field(repr=False)
    table: str
    protocol: PostgresProtocol = "two-phase-commit"
    sink_id: str = ""
    key_columns: tuple[str, ...] = ()
    on_conflict: Literal["update", "nothing"] = "update"
    dead_letter_table: str | None = None
    columns: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        self._check_common(PROTOCOLS, self.table, f"pg-{self.table}")
        if self.on_conflict not in ("update", "nothing"):
            raise ConfigError(f"{FORMAT}: on_conflict must be 'update' or 'nothing', got {self.on_conflict!r}")
        if self.protocol == "idempotent" and not self.key_columns:
            raise ConfigError(f"{FORMAT} sink {self.sink_id}: the idempotent protocol needs key_columns")

    def __repr__(self) -> str:
        return (f"PostgresSinkConfig(dsn={redact_dsn(self.dsn)!r}, table={self.table!r}, protocol={self.protocol!r}, "
                f"sink_id={self.sink_id!r}, key_columns={self.key_columns!r})")

    def to_options(self) -> dict[str, str]:
        """Spark's string options; the DSN's password goes apart, as ``password``, which Spark's
        plans and UI show redacted (a password inside ``dsn`` they would show)."""
        dsn, password = split_dsn_password(self.dsn)
        options = {"dsn": dsn, "table": self.table, "protocol": self.protocol, "sinkid": self.sink_id,
                   "keycolumns": ",".join(self.key_columns), "onconflict": self.on_conflict}
        if password is not None:
            options["password"] = password
        if self.dead_letter_table:
            options["deadlettertable"] = self.dead_letter_table
        return options

    @classmethod
    def from_options(cls, options: Mapping[str, str], columns: tuple[str, ...]) -> PostgresSinkConfig:
        get = {k.lower(): v for k, v in options.items()}.get
        if not get("dsn"):
            raise ConfigError(f"{FORMAT}: option dsn is required (a psycopg connection string)")
        return cls(
            dsn=join_dsn_password(get("dsn", ""), get("password")),
            table=get("table", ""),
            protocol=cast(PostgresProtocol, get("protocol", "two-phase-commit")),  # checked in __post_init__
            sink_id=get("sinkid", ""),
            key_columns=tuple(c.strip() for c in get("keycolumns", "").split(",") if c.strip()),
            on_conflict=cast(Literal["update", "nothing"], get("onconflict", "update")),
            dead_letter_table=get("deadlettertable") or None,
            columns=columns,
        )

    @classmethod
    def data_source(cls) -> type:
        from oncekit.sinks.postgres._spark import PostgresDataSource

        return PostgresDataSource

    def build(self, checkpoint: str) -> Sink:
        sink_type: Callable[[PostgresSinkConfig, str], Sink] = {
            "two-phase-commit": PostgresTwoPhaseCommitSink,
            "write-ahead-log": PostgresWriteAheadSink,
            "idempotent": PostgresIdempotentSink,
            "at-least-once": PostgresAtLeastOnceSink,
        }[self.protocol]
        return sink_type(self, checkpoint)


def postgres_sink(dsn: str, table: str, protocol: PostgresProtocol = "two-phase-commit", *, sink_id: str = "",
                  key_columns: Sequence[str] = (), on_conflict: Literal["update", "nothing"] = "update",
                  dead_letter_table: str | None = None, columns: Sequence[str] = ()) -> PostgresSinkConfig:
    """A PostgreSQL sink into ``table``, for :func:`~oncekit.start_query`:
    ``postgres_sink(dsn, "balances", "two-phase-commit", key_columns=("account_id",))``.

    :param dsn: the psycopg connection string of the target database. Its password never
        reaches logs, errors, reprs or Spark's plans.
    :param table: the target table, ``name`` or ``schema.name``; it must exist, with a column for
        each of the stream's columns. The kit's own tables go in the same schema.
    :param protocol: how output becomes visible exactly once (see the Protocols page):
        ``two-phase-commit`` (needs ``max_prepared_transactions`` > 0 on the server),
        ``write-ahead-log``, ``idempotent`` (needs ``key_columns``), or ``at-least-once``.
    :param sink_id: names the sink's transactions, journal and markers; default ``pg-<table>``.
        Keep it across restarts: a new id is a new sink.
    :param key_columns: a key that turns appends into merges (an upsert for ``on_conflict="update"``).
    :param on_conflict: with ``key_columns``, what a row whose key is there does: ``"update"``
        overwrites it (the last row of a partition wins), ``"nothing"`` keeps the row written first.
    :param dead_letter_table: a table for rows the target refuses (a type or constraint error),
        instead of failing the batch; None fails it with :class:`~oncekit.BadRecordError`.
    :param columns: the stream's columns; the stream writer fills them in, so a job leaves them out.
    """
    return PostgresSinkConfig(dsn=dsn, table=table, protocol=protocol, sink_id=sink_id, key_columns=tuple(key_columns),
                              on_conflict=on_conflict, dead_letter_table=dead_letter_table, columns=tuple(columns))

