"""The kit's errors raised in Spark's Python workers, raised again on the driver as the kit's own
classes (:func:`oncekit.core.errors.as_oncekit_error`)."""

from __future__ import annotations

from oncekit.core.errors import BadRecordError, FencedError, as_oncekit_error

FENCED = ("oncekit.core.errors.FencedError: sink s: query run r (epoch 1) was superseded by epoch 2: another driver "
          "took the query over, and this one stops")


class CapturedShaped(Exception):
    """Shaped as pyspark's CapturedException: its text is the JVM exception's message only, and
    the converted Java cause is kept in ``_cause``."""

    def __init__(self, desc: str, cause: BaseException | None = None) -> None:
        super().__init__(desc)
        self._cause = cause


def test_an_error_named_in_sparks_message_is_raised_as_the_kits_class() -> None:
    spark = RuntimeError("Job aborted due to stage failure: ... Traceback (most recent call last):\n  File x\n"
                         "oncekit.core.errors.BadRecordError: sink s batch 1 partition 0: row 3: not JSON\n")
    raised = as_oncekit_error(spark)
    assert isinstance(raised, BadRecordError) and str(raised) == "sink s batch 1 partition 0: row 3: not JSON"
    assert raised.__cause__ is spark


def test_an_error_of_the_driver_side_commit_named_only_in_sparks_cause_is_raised_as_the_kits_class() -> None:
    """Seen in a clean-clone make test: a newer run took the epoch after Spark planned the batch,
    so the writer Spark creates for the batch's commit refused it; Spark's StreamingQueryException
    says only "Writing job failed", and the worker's traceback is in its cause (the abort's, the
    same error, suppressed beside it)."""
    cause = CapturedShaped("[PYTHON_STREAMING_DATA_SOURCE_RUNTIME_ERROR] Failed when Python streaming data source "
                           f"perform commit: Traceback (most recent call last):\n  File x\n{FENCED}\n")
    spark = CapturedShaped("[STREAM_FAILED] Query [id = q] terminated with exception: Writing job failed. "
                           "SQLSTATE: XXKST\n=== Streaming Query ===\n", cause=CapturedShaped("Writing job failed.",
                                                                                             cause=cause))
    raised = as_oncekit_error(spark)
    assert isinstance(raised, FencedError), raised
    assert str(raised).startswith("sink s: query run r (epoch 1) was superseded by epoch 2")
    assert raised.__cause__ is spark


def test_an_error_naming_no_kit_error_is_returned_as_it_is() -> None:
    spark = CapturedShaped("Writing job failed.", cause=CapturedShaped("java.io.IOException: disk full"))
    assert as_oncekit_error(spark) is spark
