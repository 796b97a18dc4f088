"""Connections of the PostgreSQL sinks, pooled per process.

Spark reuses its Python workers across tasks and batches, and the driver-side commits run in
long-lived workers too, so a connection (TCP, authentication, its session settings) is opened once
per worker, connection string and idle bound, and then taken and given back by each task or
commit. A connection goes back to the pool only when it is idle and healthy; one that failed, or
that is left inside a transaction, is closed.

Every session waits for a lock :data:`LOCK_TIMEOUT_S` at most, and the server ends one that sits
inside a transaction without a statement longer than its idle bound
(``idle_in_transaction_session_timeout``), so a client that froze or lost its host holds no lock
another run needs for longer than that.
"""

from __future__ import annotations

import atexit
import os
import select
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus

from oncekit.connectors.postgres import connect

LOCK_TIMEOUT_S = 60
"""How long a sink's statement waits for a lock before it fails (set once per connection)."""

MAX_IDLE = 8
"""Idle connections kept per connection string; a Spark worker runs one task at a time, the
driver's workers and the listener a few commits at once."""


def usable(conn: psycopg.Connection[Any]) -> bool:
    """Open, outside any transaction, and with nothing unread on its socket: a server that
    closed the session (restart, idle timeout, administrator) has sent its goodbye there, so a
    dead connection is dropped here instead of failing the next task."""
    if conn.closed or conn.broken or conn.info.transaction_status != TransactionStatus.IDLE:
        return False
    readable, _, _ = select.select([conn.fileno()], [], [], 0)
    return not readable


class ConnectionPool:
    """Idle connections of this process, by connection string. Thread-safe."""

    def __init__(self) -> None:
        self._idle: dict[tuple[str, int], list[psycopg.Connection[Any]]] = {}
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._inherited: list[dict[tuple[str, int], list[psycopg.Connection[Any]]]] = []

    def take(self, dsn: str, autocommit: bool, idle_s: int) -> psycopg.Connection[Any]:
        """An idle connection to ``dsn`` whose session the server ends after ``idle_s`` idle inside
        a transaction, or a new one; raises psycopg.OperationalError when the server cannot be
        reached."""
        while True:
            with self._lock:
                self._after_fork()
                idle = self._idle.get((dsn, idle_s))
                conn = idle.pop() if idle else None
            if conn is None:
                break
            if usable(conn):
                conn.autocommit = autocommit
                return conn
            conn.close()
        conn = connect(dsn, autocommit=True)
        try:
            conn.execute(f"SET lock_timeout = '{LOCK_TIMEOUT_S}s'")
            conn.execute(f"SET idle_in_transaction_session_timeout = '{int(idle_s)}s'")
            conn.autocommit = autocommit
        except BaseException:
            conn.close()
            raise
        return conn

    def give_back(self, dsn: str, idle_s: int, conn: psycopg.Connection[Any]) -> None:
        """Keep ``conn`` for the next taker if it is idle and healthy, else close it."""
        if usable(conn):
            with self._lock:
                idle = self._idle.setdefault((dsn, idle_s), [])
                if os.getpid() == self._pid and len(idle) < MAX_IDLE:
                    idle.append(conn)
                    return
        conn.close()

    @contextmanager
    def connection(self, dsn: str, autocommit: bool, idle_s: int) -> Iterator[psycopg.Connection[Any]]:
        """Take a connection for the block; give it back after, close it if the block raised."""
        conn = self.take(dsn, autocommit, idle_s)
        try:
            yield conn
        except BaseException:
            conn.close()
            raise
        self.give_back(dsn, idle_s, conn)

    def close_all(self) -> None:
        with self._lock:
            if os.getpid() != self._pid:
                return
            idle = [conn for conns in self._idle.values() for conn in conns]
            self._idle.clear()
        for conn in idle:
            conn.close()

    def _after_fork(self) -> None:
        # A forked child shares its parent's sockets: closing them would end the parent's
        # sessions, so the child keeps them unused and opens its own.
        if os.getpid() != self._pid:
            self._inherited.append(self._idle)
            self._idle, self._pid = {}, os.getpid()


POOL = ConnectionPool()
atexit.register(POOL.close_all)
