"""PostgreSQL sinks (psycopg 3), one module per protocol: ``two_phase_commit``,
``write_ahead_log``, ``idempotent``, ``at_least_once``; ``config`` holds :func:`postgres_sink`.

Every protocol writes a partition with one COPY (Arrow batches rendered to CSV by pyarrow and
numpy) on connections pooled per process; where keys are declared, rows whose keys the target
already holds are merged through a staging table; never row-by-row INSERT. A row the target
refuses fails the batch with an error that names the sink, batch, partition, row and column,
or, with ``dead_letter_table``, goes there with the server's error text while the rest commits.
"""

from __future__ import annotations

from oncekit.core.errors import BadRecordError
from oncekit.sinks.postgres._common import MARKER_TABLE
from oncekit.sinks.postgres.at_least_once import PostgresAtLeastOnceSink
from oncekit.sinks.postgres.config import PROTOCOLS, PostgresSinkConfig, postgres_sink
from oncekit.sinks.postgres.idempotent import PostgresIdempotentSink
from oncekit.sinks.postgres.two_phase_commit import PostgresTwoPhaseCommitSink
from oncekit.sinks.postgres.write_ahead_log import PostgresWriteAheadSink

__all__ = [
    "MARKER_TABLE",
    "PROTOCOLS",
    "BadRecordError",
    "PostgresAtLeastOnceSink",
    "PostgresIdempotentSink",
    "PostgresSinkConfig",
    "PostgresTwoPhaseCommitSink",
    "PostgresWriteAheadSink",
    "postgres_sink",
]
