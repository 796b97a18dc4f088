"""One run of a query, as its stream writer on the driver sees it, without Spark: what the first
writer of a run does (checks, epoch, recovery), what every later writer checks, and the driver
commit and abort of a batch. The Spark adapter (:mod:`oncekit.core.spark.writer`) calls these
from ``DataSourceStreamWriter``'s methods; the deterministic simulation of overlapping drivers
(tests/sim) calls the same functions, so what it explores is what runs.

A run is one start of a query by :func:`~oncekit.core.spark.query.start_query`, named by a token
that its options carry (:class:`QueryRun`). Its first writer takes the run's epoch at the sink's
target and recovers under it; every later writer of the run acts for that epoch, and one of a run
that a newer run superseded raises FencedError.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import oncekit
from oncekit.core.engine import CheckpointEngine, RecoveryReport
from oncekit.core.errors import ConfigError, FencedError, LeaseHeldError
from oncekit.core.lease import Driver, QueryLease, require_held
from oncekit.core.protocol import Committable, SinkConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class QueryRun:
    """One start of a query, as :func:`~oncekit.core.spark.query.start_query` tells the writer
    through its options: ``token`` is new at every start; ``listener`` says that a
    :class:`~oncekit.core.spark.listener.CheckpointListener` in the driver process delivers its
    checkpoint-complete notifications, ``committer`` that the run's server-side committer does
    (:mod:`~oncekit.core.spark.committer`: the query was started from a Spark Connect client);
    ``version`` is the kit's version where the query was started, which the writer on the
    driver must share (:func:`refuse_other_version`); ``driver`` is the process that holds the
    query's lease for the run (:mod:`oncekit.core.lease`), which the first writer records the
    run's epoch for."""

    token: str | None = None
    listener: bool = False
    committer: bool = False
    version: str = ""
    driver: Driver | None = None

    TOKEN_OPTION: ClassVar[str] = "oncekit.run"
    LISTENER_OPTION: ClassVar[str] = "oncekit.listener"
    COMMITTER_OPTION: ClassVar[str] = "oncekit.committer"
    VERSION_OPTION: ClassVar[str] = "oncekit.version"
    DRIVER_OPTION: ClassVar[str] = "oncekit.driver"

    @classmethod
    def started(cls, listener: bool, committer: bool = False) -> QueryRun:
        return cls(uuid.uuid4().hex, listener, committer, oncekit.__version__, Driver.this())

    @property
    def notified(self) -> bool:
        """Whether a listener or a committer delivers the run's checkpoint-complete notifications."""
        return self.listener or self.committer

    def to_options(self) -> dict[str, str]:
        driver = "" if self.driver is None else \
            f"{self.driver.host}\t{self.driver.pid}\t{self.driver.process}\t{self.driver.boot}"
        return {self.TOKEN_OPTION: self.token or "", self.LISTENER_OPTION: str(self.listener).lower(),
                self.COMMITTER_OPTION: str(self.committer).lower(), self.VERSION_OPTION: self.version,
                self.DRIVER_OPTION: driver}

    @classmethod
    def from_options(cls, options: dict[str, str]) -> QueryRun:
        lowered = {k.lower(): v for k, v in options.items()}
        fields = lowered.get(cls.DRIVER_OPTION, "").split("\t")
        driver = Driver(fields[0], int(fields[1]), fields[2], fields[3]) if len(fields) == 4 else None
        return cls(lowered.get(cls.TOKEN_OPTION) or None, lowered.get(cls.LISTENER_OPTION) == "true",
                   lowered.get(cls.COMMITTER_OPTION) == "true", lowered.get(cls.VERSION_OPTION, ""), driver)


def refuse_plain_start(config: SinkConfig, run: QueryRun) -> str:
    """Stream writer on the driver: the run's token; ConfigError for a query started with Spark's
    own ``writeStream.format(...)...start()``, which carries no run. Such a query would run the
    sink without the lease, the fencing epoch, the batch deadline and the checkpoint-complete
    notifications, and nothing would stop two drivers, or a stalled one, from writing twice."""
    if run.token is None:
        raise ConfigError(
            f"sink {config.sink_id}: this query was started with writeStream.format({config.format_name!r})...start(), "
            "which runs the sink without the lease, the fencing epoch, the batch deadline and the checkpoint-complete "
            "notifications that make it exactly-once. Start it with oncekit.start_query(frame, sink, checkpoint, "
            "trigger=...), and wait on what it returns (awaitTermination() or await_termination())")
    return run.token


def refuse_other_version(sink_id: str, started_with: str) -> None:
    """Stream writer on the driver: a query started by another version of the kit (a Spark
    Connect client's, against the server's) may disagree on the journal, the markers and the
    transaction names, so it is refused."""
    if started_with and started_with != oncekit.__version__:
        raise ConfigError(f"sink {sink_id}: the query was started with oncekit {started_with}, but the Spark driver "
                          f"(a Spark Connect server's Python, PYSPARK_PYTHON) has oncekit {oncekit.__version__}; "
                          f"install oncekit=={started_with} there, or the same version in both")


def open_run(config: SinkConfig, checkpoint: str, run: QueryRun,
             first_checks: Callable[[CheckpointEngine], None] = lambda engine: None) -> tuple[CheckpointEngine, bool]:
    """Stream writer on the driver, each time Spark creates it: the engine acting for the run's
    epoch, and whether this is the run's first writer.

    The first writer of the run (no epoch recorded for its token yet) refuses a run whose lease
    another run holds now (this run's driver was paused past its expiry while the query started),
    runs ``first_checks`` (the adapter's), the sink's preflight, and the run's start: it takes the
    run's epoch at the target, records it in the lease (:meth:`~oncekit.core.lease.QueryLease.stamp`),
    recovers and claims the sink id (:meth:`CheckpointEngine.start_run`). A later writer acts for
    the run's epoch, raises FencedError when a newer run took the query over, and, without a
    listener or committer, delivers the notification of the batches completed since."""
    token = refuse_plain_start(config, run)
    engine = CheckpointEngine.of(config, checkpoint)
    runs = engine.journal.runs()
    epoch = runs.get(token)
    if epoch is None:
        refuse_other_version(config.sink_id, run.version)
        lease = QueryLease(checkpoint)
        holder = lease.holder()
        if holder is not None and holder.run and holder.run != token:
            raise LeaseHeldError(f"sink {config.sink_id}: query run {token} starts while another run holds the query's "
                                 f"lease ({holder.describe()}); this one stops")
        first_checks(engine)
        engine.preflight(runs)
        report = engine.start_run(token, on_epoch=lambda taken: lease.stamp(run.driver, token, taken)
                                  if run.driver is not None else None, runs=runs)
        _report(engine, report)
        return engine, True
    engine.epoch = epoch
    engine.sink.act_for(epoch)
    latest = max(runs.values())
    if latest > epoch:
        raise FencedError(f"sink {config.sink_id}: query run {token} (epoch {epoch}) was superseded by epoch "
                          f"{latest}: another driver took the query over, and this one stops")
    if not run.notified:
        # No listener: the writer Spark creates before each batch is the checkpoint-complete
        # notification of the batch before, and it must reach the sink before the next
        # batch's tasks write (a prepared transaction holds the locks of its rows).
        engine.complete()
    return engine, False


def commit_batch(engine: CheckpointEngine, run: QueryRun, batch_id: int, committables: Sequence[Committable]) -> None:
    """Driver, Spark's commit of ``batch_id`` (every task succeeded): journal and decide the batch
    before Spark logs it as committed, unless another run holds the query's lease
    (:func:`~oncekit.core.lease.require_held`: an early, named refusal; the target refuses a
    superseded run's decision all the same)."""
    require_held(engine.location, run.token or "", f"sink {engine.sink.sink_id} batch {batch_id}", engine.epoch)
    engine.checkpoint(batch_id, committables, notified=run.notified)


@dataclass(eq=False)
class WatchedRun:
    """One sink of a query run that a notifier follows across batches (the checkpoint listener),
    and the epoch the run ``token`` took once the journal shows it: a run's epoch never changes,
    so the journal's runs are listed only until then, not at every notification."""

    config: SinkConfig
    checkpoint: str
    token: str
    epoch: int | None = None

    def engine(self) -> CheckpointEngine | None:
        """The engine acting for the run's epoch; None while the run has taken none."""
        if self.epoch is not None:
            return CheckpointEngine.of(self.config, self.checkpoint, self.epoch)
        engine = CheckpointEngine.for_run(self.config, self.checkpoint, self.token)
        self.epoch = None if engine is None else engine.epoch
        return engine


def settle(config: SinkConfig, checkpoint: str, run: QueryRun) -> list[int]:
    """Driver, once the run's query stopped or drained (:meth:`~oncekit.core.spark.query.OncekitQuery.complete`):
    commit every decided batch Spark completed, acting for the run's epoch. Spark creates no
    stream writer for a run that found nothing to do (a drain after the last batch of a run that
    died in its commits): such a run takes its epoch and recovers here, as its first writer would
    have, when something completed is left to commit. Returns the batches committed."""
    engine = CheckpointEngine.for_run(config, checkpoint, run.token or "")
    if engine is not None:
        return engine.complete()
    pending = CheckpointEngine.of(config, checkpoint).uncommitted()
    if pending:
        open_run(config, checkpoint, run)  # its recovery commits them
    return pending


def _report(engine: CheckpointEngine, report: RecoveryReport) -> None:
    if report.committed_batches:  # the usual catch-up of the previous batch
        logger.info("sink %s: committed decided batches %s", engine.sink.sink_id, report.committed_batches)
    if report.aborted_leftovers:
        logger.warning("sink %s recovery: aborted leftovers %s", engine.sink.sink_id, report.aborted_leftovers)
