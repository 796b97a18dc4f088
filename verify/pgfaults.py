"""PostgreSQL faults at a known step of the sink, for the campaign (:mod:`oncekit.verify.campaign`).

A fault that must land *during* a statement cannot be timed by sleeping: a batch's PREPARE takes
milliseconds. So the harness makes the sink stop there and breaks the server while it waits:

- Two triggers on the campaign's target table (:func:`install_holds`) wait on an advisory lock
  that the harness holds only while it injects a fault: an AFTER INSERT statement trigger stops
  a session while it writes a batch's rows, a deferred constraint trigger stops it inside the
  statement that ends its transaction (``PREPARE TRANSACTION`` for two-phase commit: PostgreSQL
  runs deferred triggers at the start of PREPARE, before the transaction is prepared). Each
  trigger takes the lock shared and lets it go at once, so with the harness's lock free a write
  pays one lock round trip per statement (per row for the deferred one).
- Between two ``COMMIT PREPARED`` of a checkpoint the engine's ``mid_commit`` crash point, armed
  to hold (:func:`oncekit.core.crash.arm`), keeps the committing process waiting.

Crash recovery must keep every transaction that was prepared when the server was killed: each is
either still prepared when the server is back or has since been committed (its marker row is
visible). One that is neither was lost by the server, and :attr:`PostgresFaults.lost` names it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

from oncekit.connectors.postgres import APPLICATION_NAME, connect
from oncekit.connectors.services.base import PostgresService
from oncekit.core.crash import arm, disarm, fired_at, release
from oncekit.sinks.postgres import MARKER_TABLE
from oncekit.verify.io import prepared_transactions

logger = logging.getLogger(__name__)

# Advisory lock keys (bigint) of the two holds: "oncekit" in ASCII, then 1 (write) or 2 (end).
HOLD_WRITE = 0x6F6E63656B6901
HOLD_END = 0x6F6E63656B6902
REACH_S = 180.0  # how long a hold waits for the sink to get there (a batch planned and started)

_FUNCTION = """
CREATE OR REPLACE FUNCTION oncekit_verify_hold() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_lock_shared(TG_ARGV[0]::bigint);
    PERFORM pg_advisory_unlock_shared(TG_ARGV[0]::bigint);
    RETURN NULL;
END $$
"""


def install_holds(dsn: str, table: str) -> None:
    """Add the two hold triggers to ``table`` (the campaign's target, which the harness made)."""
    target = sql.Identifier(table)
    with connect(dsn, autocommit=True) as conn:
        with conn.transaction():  # two CREATE OR REPLACE FUNCTION at once fail one of them
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (HOLD_WRITE - 1,))
            conn.execute(_FUNCTION)
        conn.execute(sql.SQL("CREATE OR REPLACE TRIGGER oncekit_verify_hold_write AFTER INSERT ON {} "
                             "FOR EACH STATEMENT EXECUTE FUNCTION oncekit_verify_hold({})").format(
            target, sql.Literal(str(HOLD_WRITE))))
        conn.execute(sql.SQL("DROP TRIGGER IF EXISTS oncekit_verify_hold_end ON {}").format(target))
        conn.execute(sql.SQL("CREATE CONSTRAINT TRIGGER oncekit_verify_hold_end AFTER INSERT ON {} "
                             "DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION oncekit_verify_hold({})").format(
            target, sql.Literal(str(HOLD_END))))


class PostgresFaults:
    """Injects the campaign's PostgreSQL faults (kinds in :data:`~oncekit.verify.faults.POSTGRES_FAULTS`)
    into ``service``, whose database holds ``table``. Called by the campaign's ``inject``."""

    def __init__(self, service: PostgresService, table: str, crash_dir: str) -> None:
        self.service, self.table, self.crash_dir = service, table, crash_dir
        self.lost: list[str] = []  # prepared transactions crash recovery did not keep
        self._notes: dict[str, str] = {}  # per kind, what its last injection found

    def note(self, kind: str) -> str:
        """For the campaign table's detail: where the last fault of ``kind`` hit, and what crash
        recovery kept (empty for other kinds)."""
        return self._notes.pop(kind, "")

    def inject(self, kind: str, outage_s: float) -> bool:
        """Inject ``kind``; False when the sink never reached the step (nothing was injected)."""
        if kind == "postgres-kill-commit-prepared":
            return self._kill_between_commits(outage_s)
        with self._hold(HOLD_END if kind == "postgres-kill-prepare" else HOLD_WRITE) as waiting:
            if not waiting:
                return False
            logger.info("verify: %s while %s session(s) wait in: %s", kind, len(waiting), "; ".join(waiting))
            self._notes[kind] = f"; {len(waiting)} sessions held in {sorted(set(q.split(' ')[0] for q in waiting))}"
            if kind == "postgres-terminate":
                self._terminate_sessions()
            elif kind == "postgres-restart-batch":
                self.service.stop()
                time.sleep(outage_s)
                self.service.start()
            else:
                self._kill(kind, outage_s)
        return True

    def _kill_between_commits(self, outage_s: float) -> bool:
        """Hold the next checkpoint commit after its first COMMIT PREPARED, kill the server, let
        the commit go on against the dead server, bring the server back."""
        arm(self.crash_dir, "mid_commit", hold=True)
        deadline = time.monotonic() + REACH_S
        while (fired_at(self.crash_dir, "mid_commit") or {}).get("pid") is None:
            if time.monotonic() > deadline:
                if disarm(self.crash_dir, "mid_commit"):
                    return False
            time.sleep(0.05)
        self._notes["postgres-kill-commit-prepared"] = ""
        self._kill("postgres-kill-commit-prepared", outage_s, release_held=True)
        return True

    def _kill(self, kind: str, outage_s: float, release_held: bool = False) -> None:
        prepared = prepared_transactions(self.service.dsn, self.table)
        self.service.kill()
        if release_held:
            release(self.crash_dir, "mid_commit")
        time.sleep(outage_s)
        self.service.start()
        lost = self._lost(prepared)
        self.lost += lost
        self._notes[kind] = self._notes.get(kind, "") + f"; crash recovery kept {len(prepared) - len(lost)} of {len(prepared)} prepared"

    def _lost(self, prepared: list[str]) -> list[str]:
        """Of ``prepared`` (before a kill), those neither prepared now nor committed."""
        if not prepared:
            return []
        still = set(prepared_transactions(self.service.dsn, self.table))
        with connect(self.service.dsn, autocommit=True) as conn:
            committed = {row[0] for row in conn.execute(
                sql.SQL("SELECT transaction_id FROM {} WHERE transaction_id = ANY(%s)").format(
                    sql.Identifier(MARKER_TABLE)), (prepared,))}
        return [gid for gid in prepared if gid not in still and gid not in committed]

    def _terminate_sessions(self) -> None:
        """``pg_terminate_backend`` of every session of the kit (by its application_name), idle
        or busy, as an administrator would end them."""
        with connect(self._harness_dsn(), autocommit=True) as conn:
            ended = conn.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE datname = current_database() AND application_name = %s", (APPLICATION_NAME,)).fetchone()
        logger.info("verify: terminated %s sessions", ended[0] if ended else 0)

    def _harness_dsn(self) -> str:
        return make_conninfo(self.service.dsn, application_name="oncekit-verify")

    @contextmanager
    def _hold(self, key: int) -> Iterator[list[str]]:
        """Hold ``key`` until the sink's sessions wait on it; yields what they run (empty if none
        came within :data:`REACH_S`). The lock goes with the harness's session, which a server
        fault may take first."""
        conn = connect(self._harness_dsn(), autocommit=True)
        try:
            conn.execute("SELECT pg_advisory_lock(%s)", (key,))
            yield self._wait_for_holders(conn, key)
        finally:
            try:
                conn.execute("SELECT pg_advisory_unlock(%s)", (key,))
            except psycopg.Error:
                pass  # the server went away (the fault), and the lock with it
            conn.close()

    @staticmethod
    def _wait_for_holders(conn: psycopg.Connection[Any], key: int) -> list[str]:
        """What the sessions waiting on ``key`` run, once one waits (and the other partitions'
        sessions had a moment to get there too); empty after :data:`REACH_S`."""
        deadline = time.monotonic() + REACH_S
        while time.monotonic() < deadline:
            if _waiting(conn, key):
                time.sleep(0.2)
                return _waiting(conn, key)
            time.sleep(0.05)
        return []


def _waiting(conn: psycopg.Connection[Any], key: int) -> list[str]:
    rows = conn.execute(
        "SELECT a.query FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
        "WHERE l.locktype = 'advisory' AND NOT l.granted AND a.datname = current_database() "
        "AND l.classid = %s AND l.objid = %s AND l.objsubid = 1", (key >> 32, key & 0xFFFFFFFF)).fetchall()
    return [str(query)[:80] for (query,) in rows]
