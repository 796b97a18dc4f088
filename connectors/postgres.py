"""PostgreSQL: connection settings that keep the password secret, and readiness."""

from __future__ import annotations

from dataclasses import dataclass

from oncekit.connectors.base import redact_dsn
from oncekit.core.errors import ConfigError, ServiceError

MAX_PREPARED_TRANSACTIONS = 64
"""What the services oncekit starts allow (the server's default, 0, forbids two-phase commit)."""


@dataclass(frozen=True)
class PostgresConfig:
    """A psycopg 3 connection string (URL or key=value form); the password never reaches ``repr``."""

    dsn: str

    def __post_init__(self) -> None:
        if not self.dsn.strip():
            raise ConfigError("postgres: the connection string is empty; give postgresql://user:password@host:port/db")

    def __repr__(self) -> str:
        return f"PostgresConfig(dsn={redact_dsn(self.dsn)!r})"


def check_server(dsn: str) -> None:
    """Raise unless the server accepts a connection and answers a query."""
    import psycopg

    try:
        with psycopg.connect(dsn, connect_timeout=5, autocommit=True) as conn:
            conn.execute("SELECT 1")
    except psycopg.Error as exc:
        # psycopg's message can quote the connection string; never pass it on unredacted.
        raise ServiceError(f"postgres at {redact_dsn(dsn)}: {redact_dsn(str(exc)).strip()}") from exc
