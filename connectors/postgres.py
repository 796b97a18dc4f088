"""PostgreSQL: connection settings that keep the password secret, and readiness."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from oncekit.connectors.redact import redact_dsn
from oncekit.core.errors import AccessError, ConfigError, ServiceError
from oncekit.core.names import TransactionId

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


# A server cut off the network must fail a connection, not hang it: with no reply TCP would
# wait for many minutes, so a task (and the whole query) would never fail and never retry.
# Settings the DSN names itself win.
NETWORK_TIMEOUTS = {"keepalives": "1", "keepalives_idle": "5", "keepalives_interval": "2",
                    "keepalives_count": "3", "tcp_user_timeout": "15000"}


APPLICATION_NAME = "oncekit"
"""The sessions' ``application_name`` unless the DSN names one: an administrator (or the fault
harness) finds the kit's sessions in ``pg_stat_activity`` by it."""


def connect(dsn: str, autocommit: bool = False, connect_timeout: int = 10) -> psycopg.Connection[Any]:
    """A psycopg connection that fails within seconds when the server's network is gone.
    Every oncekit connection to PostgreSQL is made here."""
    given = conninfo_to_dict(dsn)
    defaults = {key: value for key, value in {**NETWORK_TIMEOUTS, "application_name": APPLICATION_NAME}.items()
                if key not in given}
    if "connect_timeout" not in given:
        defaults["connect_timeout"] = str(connect_timeout)
    return psycopg.connect(make_conninfo(dsn, **defaults), autocommit=autocommit)


# What libpq says when the server refuses the credentials or TLS cannot be trusted; a
# connection that fails this way reports no SQLSTATE.
_ACCESS_FAILURES = ("password authentication failed", "no pg_hba.conf entry", "certificate", "SSL error",
                    "does not match host name", "server does not support SSL")


def check_server(dsn: str) -> None:
    """Raise unless the server accepts a connection and answers a query: AccessError when it
    refuses the credentials or TLS fails (a certificate not trusted, a name that does not
    match), ServiceError for anything else."""
    try:
        with connect(dsn, autocommit=True, connect_timeout=5) as conn:
            conn.execute("SELECT 1")
    except psycopg.Error as exc:
        # psycopg's message can quote the connection string; never pass it on unredacted.
        message = redact_dsn(str(exc)).strip()
        refused = exc.sqlstate in ("28P01", "28000") or any(text in message for text in _ACCESS_FAILURES)
        raise (AccessError if refused else ServiceError)(f"postgres at {redact_dsn(dsn)}: {message}") from exc


def prepared_transactions(conn: psycopg.Connection[Any], prefix: str = TransactionId.PREFIX) -> list[str]:
    """Global ids of the prepared transactions in ``conn``'s database that start with ``prefix``
    (by default every one oncekit made). The one reader of ``pg_prepared_xacts``."""
    rows = conn.execute(
        "SELECT gid FROM pg_prepared_xacts WHERE database = current_database() AND starts_with(gid, %s) ORDER BY gid",
        (prefix,),
    ).fetchall()
    # SQL_ASCII databases answer bytes.
    return [gid.decode() if isinstance(gid, bytes) else str(gid) for (gid,) in rows]


@dataclass(frozen=True)
class PreparedTransaction:
    """One row of :func:`prepared_transaction_details`: a prepared transaction, how long it has
    waited and what it holds (locks on named relations keep writers and DDL out)."""

    gid: str
    age_s: float
    owner: str
    locks: int
    relations: tuple[str, ...]


def prepared_transaction_details(conn: psycopg.Connection[Any],
                                 prefix: str = TransactionId.PREFIX) -> list[PreparedTransaction]:
    """Like :func:`prepared_transactions`, with each transaction's age (server clock) and the locks
    it holds. ``pg_locks`` shows a prepared transaction's locks without a pid, under the virtual
    transaction that holds the lock on its own transaction id. Called by the status page, never by
    a sink."""
    rows = conn.execute(
        "SELECT p.gid, extract(epoch FROM now() - p.prepared)::float8, p.owner::text,"
        " (SELECT count(*) FROM pg_locks l WHERE l.pid IS NULL AND l.virtualtransaction = v.vxid),"
        " (SELECT coalesce(array_agg(DISTINCT l.relation::regclass::text), '{}') FROM pg_locks l"
        "   WHERE l.pid IS NULL AND l.virtualtransaction = v.vxid AND l.relation IS NOT NULL)"
        " FROM pg_prepared_xacts p LEFT JOIN LATERAL (SELECT l.virtualtransaction AS vxid FROM pg_locks l"
        "   WHERE l.locktype = 'transactionid' AND l.transactionid = p.transaction AND l.pid IS NULL LIMIT 1) v ON true"
        " WHERE p.database = current_database() AND starts_with(p.gid, %s) ORDER BY p.gid",
        (prefix,),
    ).fetchall()
    return [PreparedTransaction(gid.decode() if isinstance(gid, bytes) else str(gid), float(age), str(owner),
                                int(locks), tuple(sorted(str(r) for r in relations)))
            for gid, age, owner, locks, relations in rows]
