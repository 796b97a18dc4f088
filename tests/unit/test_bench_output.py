"""``make bench`` prints its report and nothing else (issue 37 item 5): what Spark's JVM and
pyspark's workers print (log4j lines, "Starting Streaming TransformWithStateInPandas Python
worker ... Received UDF from JVM") goes to a log file beside it; the bench's own errors still
reach the terminal."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = ("import sys; print('Starting Streaming TransformWithStateInPandas Python worker'); "
         "print('WARN TaskSetManager: chatter', file=sys.stderr)")


def test_the_report_reaches_stdout_and_child_processes_chatter_goes_to_the_log(tmp_path: Path) -> None:
    log = tmp_path / "spark-output.log"
    script = (f"import subprocess, sys\n"
              f"from benchmarks.output import report_only\n"
              f"with report_only({str(log)!r}) as report:\n"
              f"    subprocess.run([sys.executable, '-c', {CHILD!r}], check=True)\n"
              f"    print('| case | records/s |', file=report)\n"
              f"    print('an error of the bench', file=sys.stderr)\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "| case | records/s |" in done.stdout and "Starting Streaming" not in done.stdout, done.stdout
    assert "chatter" not in done.stderr and "an error of the bench" in done.stderr, done.stderr
    kept = log.read_text()
    assert "Starting Streaming TransformWithStateInPandas" in kept and "WARN TaskSetManager: chatter" in kept


def test_the_report_as_markdown_keeps_the_tables_and_makes_comment_lines_paragraphs() -> None:
    from benchmarks.__main__ import markdown

    text = markdown(["# all: 12 s", "\n## 1. Source\nnote\n\n| case | s |\n|---|--:|\n| kit | 1.0 |"])
    assert "\nall: 12 s\n" in text and "# all" not in text
    assert "## 1. Source" in text and "| kit | 1.0 |" in text
