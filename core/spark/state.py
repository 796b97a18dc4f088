"""Rescaling a stopped query's state through Spark's offline state repartitioning.

Spark fixes the number of state partitions (the shuffle partitions) at a query's first batch;
PySpark 4.2 added ``StreamingCheckpointManager.repartition``, which rewrites a stopped query's
state into another number of partitions and logs the result as one more batch, with no input.
In PySpark 4.3 it covers, by the operator names it gives them: streaming aggregation
(``stateStoreSave``), ``dropDuplicates`` (``dedupe``), ``dropDuplicatesWithinWatermark``
(``dedupeWithinWatermark``), session windows, stream-stream joins, ``flatMapGroupsWithState``
and ``applyInPandasWithState``, and transformWithState in Scala, pandas and Python rows
(value, list and map state, with or without TTL, and timers). It needs a checkpoint written by
Spark 4.0 or later, a state store provider it knows (RocksDB, the kit's default, is one), and a
last batch that committed. For anything else it raises a named error class, which :func:`repartition_state`
turns into :class:`StateRescaleError` naming the query, the operator and what to do.

Called by ``ReferencePipeline.restore`` on the driver, in the user's process (the checkpoint
manager needs the session's JVM).
"""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING

from oncekit.core.errors import StateRescaleError
from oncekit.core.spark_log import SparkLog

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = ["StateRescaleError", "repartition_state"]

logger = logging.getLogger(__name__)

# Spark's error classes of a refused repartition, and what the kit's user can do about each.
_ADVICE = {
    "UNSUPPORTED_STATEFUL_OPERATOR": "Spark cannot repartition this operator's state; restore without "
                                     "state partitions (the savepoint's are kept), or start the query afresh",
    "UNSUPPORTED_TRANSFORM_WITH_STATE_VARIABLE_TYPE": "Spark cannot repartition this kind of state variable; "
                                                      "restore without state partitions (the savepoint's are kept)",
    "UNSUPPORTED_PROVIDER": "Spark cannot repartition this state store provider's state; the kit's default, "
                            "RocksDB, it can; or restore without state partitions",
    "LAST_BATCH_FAILED": "the last batch did not commit; run the restored query until it does, then rescale",
    "SHUFFLE_PARTITIONS_ALREADY_MATCH": "the state already has that many partitions",
}
_ERROR_CLASS = re.compile(r"\[STATE_REPARTITION_INVALID_(?:CHECKPOINT|PARAMETER)\.([A-Z_]+)\]")
_OPERATOR = re.compile(r"(?:operator|variable type) (\S+)")


def _messages(error: BaseException) -> str:
    """The error's message and its causes' (Spark's refusal may be the cause of a state-schema
    read error); a captured Spark exception keeps its causes as ``_cause``, Python's as ``__cause__``."""
    found, seen = [], set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        found.append(str(current))
        current = getattr(current, "_cause", None) or current.__cause__
    return "\n".join(found)


def repartition_state(spark: SparkSession, checkpoint: str, partitions: int, query: str) -> bool:
    """Rescale the state of the stopped query checkpointed at ``checkpoint`` to ``partitions``
    partitions; False when it already has that many or keeps no state (nothing to do: a
    stateless query's partitioning is its input's). The query's next start picks the new
    partitioning up from the batch Spark logs for it. Raises StateRescaleError when Spark
    refuses, with the query, the operator and what to do instead."""
    if partitions < 1:
        raise StateRescaleError(f"query {query}: state partitions must be at least 1, got {partitions}")
    log = SparkLog(checkpoint)
    current = log.state_partitions()
    if current == partitions:
        return False
    if not log.stateful():
        logger.info("query %s: keeps no state, nothing to repartition at %s", query, checkpoint)
        return False
    try:
        spark._streamingCheckpointManager.repartition(checkpoint, partitions)
    except Exception as exc:  # Py4JJavaError or a captured Spark exception: the error class is in the text
        text = _messages(exc)
        found = _ERROR_CLASS.search(text)
        if found is None:
            raise StateRescaleError(f"query {query}: Spark could not repartition the state at {checkpoint} from "
                                    f"{current} to {partitions} partitions: {text.splitlines()[0][:500]}") from exc
        kind = found.group(1)
        operator = _OPERATOR.search(text[found.end():])
        what = f" (operator {operator.group(1).rstrip('.')})" if operator and "UNSUPPORTED" in kind else ""
        raise StateRescaleError(f"query {query}: Spark refused to repartition the state from {current} to "
                                f"{partitions} partitions: {kind}{what}; "
                                f"{_ADVICE.get(kind, 'see Spark error class STATE_REPARTITION_INVALID_CHECKPOINT.' + kind)}"
                                ) from exc
    logger.info("query %s: state repartitioned from %s to %s partitions at %s", query, current, partitions, checkpoint)
    return True
