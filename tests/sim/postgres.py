"""PostgreSQL in the simulation: a model of the server the PostgreSQL sinks' target port
(:class:`oncekit.sinks.postgres._target.PostgresTarget`) talks to, so the sinks' real protocol code
runs against it. The contract test (tests/sim/test_model_contract.py) runs the same operations on
the real server and on this model and checks that they answer alike.

What it models: transactions of sessions that belong to a process (a driver, an executor), the
sink's row in ``oncekit_sinks`` with its share and exclusive locks, the markers' unique key per
(sink, batch, partition) held by a transaction in flight or prepared, PREPARE TRANSACTION /
COMMIT PREPARED / ROLLBACK PREPARED, the decisions and recorded checkpoints, the target's rows.
A session whose process died is ended at once (its transaction rolls back, its locks go); one
that sits idle inside a transaction longer than its bound is ended by the server, as
``idle_in_transaction_session_timeout`` does, when another session needs what it holds. A lock
wait gives up after the pool's lock timeout. Rows of the target are not locked by key (the
protocols' fencing does not rest on them).
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from oncekit.core.errors import CommitError, FencedError, OncekitError
from oncekit.core.names import TransactionId
from oncekit.core.protocol import Committable, SinkOwner, TaskInfo
from oncekit.sinks.postgres._common import CHECKPOINT_TABLE, DECISION_TABLE, MARKER_TABLE, PARTITION_TABLE
from oncekit.sinks.postgres._pool import LOCK_TIMEOUT_S
from oncekit.sinks.postgres._target import DRIVER_IDLE_S, PostgresTarget, PreparingTransaction, older_batch, task_idle_s
from tests.sim.scheduler import Label, Process, Scheduler, prefixed, text

if TYPE_CHECKING:
    from oncekit.sinks.postgres.config import PostgresSinkConfig

DSN_PREFIX = "sim-postgres:"


class SessionLost(OncekitError):
    """The model's psycopg.OperationalError: the server ended the session."""


@dataclass(eq=False)
class Txn:
    """One transaction of one session."""

    process: Process
    idle_s: float
    started: float
    last_active: float
    rows: list[tuple[str, Any]] = field(default_factory=list)
    marker: tuple[str, int, int] | None = None
    marker_row: tuple[str, str, int, int, int] | None = None
    checkpoint: tuple[str, int] | None = None
    share: set[str] = field(default_factory=set)
    ended: bool = False
    gid: str | None = None


class PgServer:
    """One PostgreSQL database of the simulated cluster."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.sinks: dict[str, dict[str, Any]] = {}
        self.exclusive: dict[str, Txn] = {}  # sink row: the transaction updating it (one statement)
        self.markers: dict[str, tuple[str, int, int]] = {}  # committed: gid -> (sink, batch, partition)
        self.marker_keys: dict[tuple[str, int, int], Txn | str] = {}  # key -> holder, or "committed"
        self.decisions: dict[tuple[str, int, int], str] = {}
        self.checkpoints: dict[tuple[str, int], int] = {}
        self.checkpoint_keys: dict[tuple[str, int], Txn] = {}
        self.partitions: dict[tuple[str, int], int] = {}  # oncekit_partitions
        self.appended: dict[str, collections.Counter[Any]] = collections.defaultdict(collections.Counter)
        self.upserted: dict[str, dict[Any, Any]] = collections.defaultdict(dict)
        self.prepared: dict[str, Txn] = {}
        self.open: list[Txn] = []
        self.history: list[tuple[float, str, Any, Any]] = []  # (time, table, key, row) of upserts, for invariants

    # -- sessions ------------------------------------------------------------------------------

    def begin(self, idle_s: float) -> Txn:
        actor = self.scheduler.current
        assert actor is not None
        txn = Txn(actor.process, idle_s, self.scheduler.time, self.scheduler.time)
        self.open.append(txn)
        if self.end_of not in actor.process.on_kill:
            actor.process.on_kill.append(self.end_of)
        return txn

    def end_of(self) -> None:
        """A process died: the server ends its sessions (their transactions roll back)."""
        for txn in list(self.open):
            if txn.process.dead:
                self.rollback(txn)

    def statement(self, txn: Txn, label: Label) -> None:
        """A statement of ``txn``: a scheduling point, after which the session may be gone."""
        txn.last_active = self.scheduler.time
        self.scheduler.step(prefixed("postgres ", label))
        if txn.ended:
            raise SessionLost(f"the server ended the session ({text(label)}): idle in its transaction too long")
        txn.last_active = self.scheduler.time

    def _expire(self, holder: Txn | str | None) -> None:
        """End ``holder``'s session if it sat idle inside its transaction past its bound."""
        if isinstance(holder, Txn) and holder.gid is None and not holder.ended \
                and self.scheduler.time - holder.last_active > holder.idle_s:
            self.rollback(holder)

    def wait(self, txn: Txn | None, free: Any, holders: Any, label: Label) -> None:
        """Wait until ``free()``, ending expired holders; the lock timeout after."""
        def ready() -> bool:
            for holder in holders():
                self._expire(holder)
            return bool(free())

        if txn is not None:
            txn.last_active = self.scheduler.time
        if not self.scheduler.wait_until(ready, LOCK_TIMEOUT_S, label):
            raise OncekitError(f"{text(label)}: lock timeout")
        if txn is not None:
            if txn.ended:
                raise SessionLost(f"the server ended the session ({text(label)})")
            txn.last_active = self.scheduler.time

    def commit(self, txn: Txn) -> None:
        for table, row in txn.rows:
            if isinstance(row, tuple) and len(row) == 2 and table.endswith("#upsert"):
                key, value = row
                self.upserted[table[:-7]][key] = value
                self.history.append((self.scheduler.time, table[:-7], key, value))
            else:
                self.appended[table][row] += 1
        if txn.marker is not None:
            self.marker_keys[txn.marker] = "committed"
            assert txn.marker_row is not None
            self.markers[txn.marker_row[0]] = txn.marker
        if txn.checkpoint is not None:
            self.checkpoints[txn.checkpoint] = 1
            self.checkpoint_keys.pop(txn.checkpoint, None)
        self._release(txn)

    def rollback(self, txn: Txn) -> None:
        if txn.marker is not None and self.marker_keys.get(txn.marker) is txn:
            del self.marker_keys[txn.marker]
        if txn.checkpoint is not None and self.checkpoint_keys.get(txn.checkpoint) is txn:
            del self.checkpoint_keys[txn.checkpoint]
        self._release(txn)

    def _release(self, txn: Txn) -> None:
        txn.ended = True
        txn.share.clear()
        for sink, holder in list(self.exclusive.items()):
            if holder is txn:
                del self.exclusive[sink]
        if txn in self.open:
            self.open.remove(txn)
        if txn.gid is not None:
            self.prepared.pop(txn.gid, None)

    # -- the sink's row ------------------------------------------------------------------------

    def share_holders(self, sink: str) -> list[Txn]:
        return [t for t in [*self.open, *self.prepared.values()] if sink in t.share and not t.ended]

    def lock_share(self, txn: Txn, sink: str) -> None:
        self.wait(txn, lambda: sink not in self.exclusive, lambda: [self.exclusive.get(sink)],
                  lambda: f"share lock on {sink}'s row")
        txn.share.add(sink)

    def update_row(self, sink: str, change: Any) -> Any:
        """One UPDATE of the sink's row (its own implicit transaction): waits for share holders."""
        txn = self.begin(DRIVER_IDLE_S)
        try:
            self.wait(txn, lambda: not [t for t in self.share_holders(sink) if t is not txn] and sink not in self.exclusive,
                      lambda: self.share_holders(sink), lambda: f"row lock on {sink}'s row")
            self.exclusive[sink] = txn
            self.statement(txn, lambda: f"update {sink}'s row")
            result = change(self.sinks.setdefault(sink, {"query_id": "", "checkpoint": "", "epoch": 0}))
        except BaseException:
            self.rollback(txn)
            raise
        self.commit(txn)
        return result


class SimPostgresTarget(PostgresTarget):
    """The target port on the model (one per sink object, as the psycopg one)."""

    def __init__(self, config: PostgresSinkConfig, server: PgServer) -> None:
        super().__init__(config)
        self.server, self.sink_id = server, config.sink_id
        self.table = config.table
        self.keyed = bool(config.key_columns)

    def _fence(self, txn: Txn, epoch: int, where: str, lock: bool) -> None:
        if epoch < 1:
            raise FencedError(f"sink {self.sink_id} {where}: acts for no query run (epoch {epoch})")
        if lock:
            self.server.lock_share(txn, self.sink_id)
        held = self.server.sinks.get(self.sink_id, {}).get("epoch", 0)
        if held > epoch:
            raise FencedError(f"sink {self.sink_id} {where}: this run (epoch {epoch}) was superseded by epoch {held}")

    def _rows(self, batch: pa.RecordBatch) -> list[tuple[str, Any]]:
        columns = batch.to_pydict()
        if self.keyed:
            table = self.table + "#upsert"
            return [(table, row) for row in zip(columns[self.config.key_columns[0]], columns["payload"])]
        return [(self.table, row) for row in zip(*columns.values())]

    # -- driver: checks, epoch, owner ----------------------------------------------------------

    def preflight(self) -> None:
        self.server.scheduler.step(lambda: f"postgres preflight {self.sink_id}")

    def take_epoch(self, checkpoint: str, floor: int) -> int:
        def raise_epoch(row: dict[str, Any]) -> int:
            row["epoch"] = max(row["epoch"], floor) + 1
            return int(row["epoch"])

        return int(self.server.update_row(self.sink_id, raise_epoch))

    def hold_epoch(self, checkpoint: str, epoch: int) -> None:
        def hold(row: dict[str, Any]) -> int:
            row["epoch"] = max(row["epoch"], epoch)
            return int(row["epoch"])

        if self.server.update_row(self.sink_id, hold) > epoch:
            raise FencedError(f"sink {self.sink_id}: this run (epoch {epoch}) was superseded")

    def owner(self) -> SinkOwner | None:
        self.server.scheduler.step(lambda: f"postgres owner of {self.sink_id}")
        row = self.server.sinks.get(self.sink_id)
        return None if row is None or not row["query_id"] else SinkOwner(row["query_id"], row["checkpoint"])

    def record_owner(self, owner: SinkOwner, epoch: int) -> None:
        def claim(row: dict[str, Any]) -> bool:
            if row["epoch"] > epoch or epoch < 1:
                return False
            row["query_id"], row["checkpoint"] = owner.query_id, owner.checkpoint
            return True

        if not self.server.update_row(self.sink_id, claim):
            raise FencedError(f"sink {self.sink_id}: recording the owner: this run (epoch {epoch}) was superseded")

    def delete_batch_records(self, table: str, before: int | None, epoch: int) -> int:
        server = self.server
        txn = server.begin(DRIVER_IDLE_S)
        try:
            server.statement(txn, lambda: f"delete {table} of {self.sink_id}")
            self._fence(txn, epoch, f"deleting rows of {table}", lock=True)
            server.statement(txn, "commit")
        except BaseException:
            server.rollback(txn)
            raise

        def old(batch: int) -> bool:
            return before is None or batch < before

        deleted = 0
        if table == MARKER_TABLE:
            for gid, (sink, batch, partition) in list(server.markers.items()):
                if sink == self.sink_id and old(batch):
                    del server.markers[gid]
                    server.marker_keys.pop((sink, batch, partition), None)
                    deleted += 1
        elif table == DECISION_TABLE:
            for key in [k for k in server.decisions if k[0] == self.sink_id and old(k[1])]:
                del server.decisions[key]
                deleted += 1
        elif table == PARTITION_TABLE:
            for key in [k for k in server.partitions if k[0] == self.sink_id]:
                del server.partitions[key]
                deleted += 1
        elif table == CHECKPOINT_TABLE:
            for key in [k for k in server.checkpoints if k[0] == self.sink_id and old(k[1])]:
                del server.checkpoints[key]
                deleted += 1
        server.commit(txn)
        return deleted

    # -- two-phase commit ----------------------------------------------------------------------

    def prepared(self, batch_ids: Iterable[int] | None) -> list[Committable]:
        self.server.scheduler.step(lambda: f"postgres list prepared of {self.sink_id}")
        wanted = None if batch_ids is None else set(batch_ids)
        found = []
        for gid in sorted(self.server.prepared):
            t = TransactionId.parse(gid)
            if t is not None and t.sink_id == self.sink_id and (wanted is None or t.batch_id in wanted):
                found.append(Committable(self.sink_id, t.batch_id, t.partition_id, t.attempt, 0, transaction_id=gid,
                                         epoch=t.epoch))
        return found

    def finish_prepared(self, transaction_id: str, commit: bool) -> bool:
        self.server.scheduler.step(lambda: f"postgres {'commit' if commit else 'rollback'} prepared {transaction_id}")
        txn = self.server.prepared.get(transaction_id)
        if txn is None:
            return False
        (self.server.commit if commit else self.server.rollback)(txn)
        return True

    def marker_visible(self, transaction_id: str) -> bool:
        self.server.scheduler.step(lambda: f"postgres marker of {transaction_id}")
        return transaction_id in self.server.markers

    def begin(self, task: TaskInfo) -> PreparingTransaction:
        txn = self.server.begin(task_idle_s())
        self.server.statement(txn, lambda: f"begin {task.transaction_id}")
        return _SimPreparing(self, task, txn)

    def decide(self, batch_id: int, epoch: int, verdict: str) -> str:
        server = self.server
        txn = server.begin(DRIVER_IDLE_S)
        try:
            server.statement(txn, lambda: f"{verdict} {self.sink_id} batch {batch_id} epoch {epoch}")
            if verdict == "decided":
                self._fence(txn, epoch, f"batch {batch_id}", lock=True)
            server.statement(txn, "commit")
        except BaseException:
            server.rollback(txn)
            raise
        standing = server.decisions.setdefault((self.sink_id, batch_id, epoch), verdict)
        server.commit(txn)
        return standing

    def decisions(self, batch_ids: Iterable[int]) -> dict[int, set[int]]:
        self.server.scheduler.step(lambda: f"postgres decisions of {self.sink_id}")
        wanted = set(batch_ids)
        found: dict[int, set[int]] = {b: set() for b in wanted}
        for (sink, batch, epoch), verdict in self.server.decisions.items():
            if sink == self.sink_id and batch in wanted and verdict == "decided":
                found[batch].add(epoch)
        return found

    # -- write-ahead log, idempotent, at-least-once --------------------------------------------

    def publish(self, batch_id: int, epoch: int, rows: int,
                parts: Iterator[tuple[TaskInfo, Iterator[pa.RecordBatch]]]) -> bool:
        server, key = self.server, (self.sink_id, batch_id)
        txn = server.begin(DRIVER_IDLE_S)
        try:
            server.statement(txn, lambda: f"publish {self.sink_id} batch {batch_id}: recorded?")
            if key in server.checkpoints:
                server.rollback(txn)
                return False
            for task, batches in parts:
                for batch in batches:
                    txn.rows += self._rows(batch)
                server.statement(txn, lambda: f"copy partition {task.partition_id}")
            self._fence(txn, epoch, f"batch {batch_id}", lock=True)
            server.wait(txn, lambda: key not in server.checkpoint_keys, lambda: [server.checkpoint_keys.get(key)],
                        lambda: f"recording {key}")
            if key in server.checkpoints:
                server.rollback(txn)
                return False
            server.checkpoint_keys[key], txn.checkpoint = txn, key
            server.statement(txn, "commit")
        except BaseException:
            server.rollback(txn)
            raise
        server.commit(txn)
        return True

    def published(self, batch_id: int) -> bool:
        self.server.scheduler.step(lambda: f"postgres recorded {self.sink_id} batch {batch_id}?")
        return (self.sink_id, batch_id) in self.server.checkpoints

    def write_and_commit(self, task: TaskInfo, batches: Iterator[pa.RecordBatch], epoch: int | None) -> int:
        server = self.server
        txn = server.begin(task_idle_s())
        rows = 0
        try:
            for batch in batches:
                txn.rows += self._rows(batch)
                rows += batch.num_rows
                server.statement(txn, lambda: f"copy {task.sink_id} {task.batch_id}/{task.partition_id}")
            if epoch is not None:
                where = f"batch {task.batch_id} partition {task.partition_id}"
                self._fence(txn, epoch, where, lock=True)
                if any(batch > task.batch_id for (sink_id, _), batch in server.partitions.items()
                       if sink_id == self.sink_id):
                    raise older_batch(self.sink_id, where)
                server.partitions[(self.sink_id, task.partition_id)] = task.batch_id
            server.statement(txn, "commit")
        except BaseException:
            server.rollback(txn)
            raise
        server.commit(txn)
        return rows


class _SimPreparing(PreparingTransaction):
    def __init__(self, target: SimPostgresTarget, task: TaskInfo, txn: Txn) -> None:
        super().__init__(task)
        self.target, self.txn, self.count = target, txn, 0

    def write(self, batch: pa.RecordBatch) -> None:
        self.txn.rows += self.target._rows(batch)
        self.count += batch.num_rows
        self.target.server.statement(self.txn, lambda: f"copy {self.task.transaction_id}")

    def prepare(self) -> int:
        server, task, txn = self.target.server, self.task, self.txn
        key = (task.sink_id, task.batch_id, task.partition_id)
        try:
            self.target._fence(txn, task.epoch, f"batch {task.batch_id} partition {task.partition_id}", lock=False)
            server.statement(txn, lambda: f"insert marker {task.transaction_id}")
            server.wait(txn, lambda: server.marker_keys.get(key) in (None, "committed"),
                        lambda: [server.marker_keys.get(key)], lambda: f"marker key {key}")
            if server.marker_keys.get(key) == "committed":
                raise CommitError(f"{task.transaction_id}: duplicate key (sink, batch, partition)")
            server.marker_keys[key], txn.marker = txn, key
            txn.marker_row = (task.transaction_id, task.sink_id, task.batch_id, task.partition_id, self.count)
            server.statement(txn, lambda: f"prepare {task.transaction_id}")
        except BaseException:
            server.rollback(txn)
            raise
        txn.gid = task.transaction_id
        server.open.remove(txn)
        server.prepared[task.transaction_id] = txn
        return self.count

    def abort(self) -> None:
        self.target.server.rollback(self.txn)

