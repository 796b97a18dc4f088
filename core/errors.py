"""Every error oncekit raises: one root class, one subclass per kind of failure, all here.

A caller catches the kit's failures apart from Spark's and the clients' with
:class:`OncekitError`. Messages name what failed and where (service, sink, batch, partition,
column or offset) and never carry a secret. The modules that raise an error re-export it, so
``oncekit.sinks.postgres.BadRecordError`` and ``oncekit.core.errors.BadRecordError`` are one class.
"""

from __future__ import annotations

import re


class OncekitError(Exception):
    """Root of every error oncekit raises."""


class ConfigError(OncekitError):
    """A setting is missing, malformed or contradicts another; the message says what to fix."""


class ServiceError(OncekitError):
    """An external service (Kafka, PostgreSQL, the container engine) could not be started,
    reached or controlled; the message says in one line what is missing."""


class AccessError(ServiceError):
    """A service refused the kit's credentials, or its certificate is not one the kit trusts:
    waiting does not help, so nothing retries it. The message names the service and what it
    said, never the secret."""


class CommitError(OncekitError):
    """A committable could not be committed and was not committed before (for example, a
    prepared transaction vanished without its marker: someone rolled it back)."""


class BadRecordError(OncekitError):
    """PostgreSQL refused a row; the message names sink, batch, partition, row and column."""


class RecordError(OncekitError):
    """A Kafka record could not be written; the message names sink, batch, partition and row."""


class NonDeterministicReplayError(OncekitError):
    """A replayed batch would write other records than the committed attempt wrote."""


class LeaseHeldError(ConfigError):
    """Another live driver holds the query's lease (:mod:`oncekit.core.lease`): this one does not
    start it. A standby that meets it lost the race to take over, and waits again."""


class LeaseLostError(OncekitError):
    """Another driver holds the query's lease (:mod:`oncekit.core.lease`): this one was paused
    past its expiry and a standby took over, so this one stops its query."""


class FencedError(OncekitError):
    """A newer run of the query took the sink over (its epoch is above this run's), so the sink
    refuses what this run does: a driver paused past its lease woke up, or two drivers started on
    one checkpoint. Nothing this run did after the takeover changed the output; no restart of
    this run can go on, so restart strategies stop at it."""


class ReplayError(OncekitError):
    """A checkpoint replays a batch that a sink cannot compare with what it wrote (the checkpoint
    is older than the sink's output); the message says what to do."""


class TaskInputCutError(OncekitError):
    """Spark stopped sending a task's input before its end (the task was killed, or what fed it
    failed), or a fan-out task ended a target's input because another target or the routing
    failed; the task commits nothing and Spark's retry or the query's restart replays it."""


class DataLossError(OncekitError):
    """Records the query needs were deleted (retention) or the topic was recreated."""


class SourceReadError(OncekitError):
    """A task could not read its offset range."""


class StallError(OncekitError):
    """A wait passed its deadline: a client call that did not return, or a batch that Spark
    planned and did not commit in time. The message names sink, batch, partition and the step
    (or the query and batch), so that the task or query fails and its restart takes over."""


class QueryStuckError(StallError):
    """A stalled query did not stop when the batch watchdog stopped it: the driver process must be
    restarted (no restart inside it can start the query again while Spark holds the old one)."""


class UnsettledMarkerError(StallError):
    """A Kafka sink's marker partition still holds an undecided transaction of the writer's own
    transactional id (its last commit not yet marked by the broker, or a newer producer's open
    transaction), so the latest marker cannot be read yet. A pooled producer starts over with a
    new one, whose ``init_transactions`` settles the id; a new producer that still meets this
    fails the task."""


class RestartsExhaustedError(OncekitError):
    """The restart strategy gave up; ``__cause__`` is the last failure."""


class SavepointError(OncekitError):
    """A savepoint cannot be created, found, restored or deleted; the message says why and
    what to do."""


class StateRescaleError(SavepointError):
    """Spark cannot repartition a restored query's state to the number of state partitions
    asked for; the message names the query, the operator and what to do instead."""


class PipelineError(OncekitError):
    """A query of the reference pipeline failed; ``__cause__`` is Spark's error."""


class VerifyError(OncekitError):
    """The pipeline under test could not be run at all (as opposed to a failed verdict)."""


_NAMED = re.compile(r"\boncekit\.core\.errors\.(\w+): ([^\n]*)")


def as_oncekit_error(error: BaseException) -> BaseException:
    """``error`` as the kit's own class where it is one, or carries one: an error raised in a
    Python worker (a task on an executor, a stream writer's commit in the driver's planner
    process) reaches the driver only as the text of Spark's StreamingQueryException or of one
    of its causes, whose traceback names the class (the outermost text that names one; in it,
    the last one named is the error that ended the worker). That class is raised again on the
    driver with the worker's message, and Spark's exception as its ``__cause__``, so ``except
    BadRecordError`` works in a job. Anything else is returned as it is. Called by
    :meth:`~oncekit.core.spark.query.OncekitQuery.await_termination` and by the restart strategy."""
    if isinstance(error, OncekitError):
        return error
    for text in _texts(error):
        found = [(kind, message) for name, message in _NAMED.findall(text)
                 if isinstance(kind := globals().get(name), type) and issubclass(kind, OncekitError)]
        if found:
            kind, message = found[-1]
            translated: OncekitError = kind(message)
            translated.__cause__ = error
            return translated
    return error


def _texts(error: BaseException, depth: int = 8) -> list[str]:
    """The texts of ``error`` and of its causes, outermost first. A kit error raised in the
    stream writer Spark creates for a batch's driver-side commit is named only in a cause
    ("Writing job failed." on top); pyspark keeps the converted Java cause in ``_cause``."""
    texts: list[str] = []
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen and len(texts) < depth:
        seen.add(id(current))
        try:
            texts.append(str(current))
        except Exception:  # noqa: BLE001 - pyspark's text asks the JVM, which may be gone: the others still count
            pass
        cause = getattr(current, "_cause", None)
        current = cause if isinstance(cause, BaseException) else current.__cause__
    return texts
