"""The bench's report alone on the terminal: what Spark's JVM and pyspark's Python workers print
(log4j lines, "Starting Streaming TransformWithStateInPandas Python worker ... Received UDF from
JVM") goes to a log file instead. They write to the process's file descriptors 1 and 2, which
they inherit; the report and Python's own errors keep the terminal through duplicates of them."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO


@contextmanager
def report_only(log: str) -> Iterator[TextIO]:
    """Within: descriptors 1 and 2 (and so every process started meanwhile, Spark's JVM with its
    workers among them) write to ``log``; the stream given writes to the terminal's stdout, and
    ``sys.stdout`` / ``sys.stderr`` stay on the terminal. Called by ``python -m benchmarks``."""
    os.makedirs(os.path.dirname(log) or ".", exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    terminal_out, terminal_err = os.dup(1), os.dup(2)
    report = os.fdopen(os.dup(terminal_out), "w", buffering=1)
    python_out, python_err = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = report, os.fdopen(os.dup(terminal_err), "w", buffering=1)
    target = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(target, 1)
    os.dup2(target, 2)
    os.close(target)
    try:
        yield report
    finally:
        report.flush()
        sys.stderr.flush()
        os.dup2(terminal_out, 1)
        os.dup2(terminal_err, 2)
        os.close(terminal_out)
        os.close(terminal_err)
        sys.stderr.close()
        report.close()
        sys.stdout, sys.stderr = python_out, python_err
