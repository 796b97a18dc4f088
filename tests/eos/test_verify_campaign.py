"""The fault campaign behind ``oncekit verify``: seeded randomized campaigns against the kit's
Postgres and Kafka sinks, one on a Spark standalone cluster, the known-bad configurations the
checker must catch, and the command line as a new user runs it.

``ONCEKIT_VERIFY_FAULTS`` (default 3) sizes the randomized campaigns, ``ONCEKIT_RANDOMIZED_RUNS``
(default 1, drawn; 2 in ``make test-long``) says how many of their two pipelines run, and ``ONCEKIT_VERIFY_SEED``
(drawn anew for every run by tests/conftest.py, and printed) draws their faults: a longer
campaign, or the same faults again, is one variable away. Every campaign's table is printed
at the end of the run (see conftest's terminal summary) and written as JSON under
``.oncekit/verify/``.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from oncekit.connectors import Services
from oncekit.connectors.services.spark_cluster import StandaloneCluster
from oncekit.verify import CampaignReport, Fault, Upstream, run_campaign, schedule, table, write_json
from tests.docs.console import console_commands
from tests.eos.pipeline import drawn
from tests.sizes import full_size

pytestmark = [pytest.mark.services, pytest.mark.spark]

FAULTS = int(os.environ.get("ONCEKIT_VERIFY_FAULTS", "3"))
SEED = int(os.environ["ONCEKIT_VERIFY_SEED"])
REPORTS = Path(__file__).resolve().parents[2] / ".oncekit" / "verify"


def record(report: CampaignReport, name: str, campaign_tables: list[str]) -> str:
    """Keep the table for the end-of-run summary and the JSON for CI; return the table."""
    REPORTS.mkdir(parents=True, exist_ok=True)
    write_json(str(REPORTS / f"{name}.json"), report)
    text = table(report)
    # A stall is recovered from, not hidden: its stacks go to the end-of-run summary as well (also
    # those of a query that never caught up though its output was complete: recovery nan).
    waited = any(r.stalled or (math.isnan(r.recovery_s) and r.verdict == "exactly-once") for r in report.results)
    campaign_tables.append(text + (f"\n{report.log[:12000]}" if waited else ""))
    return f"{text}\nreproduce: ONCEKIT_VERIFY_SEED={report.seed} ONCEKIT_VERIFY_FAULTS={len(report.results)}\n{report.log}"


def test_schedule_is_reproducible_from_seed() -> None:
    assert schedule(11, 8) == schedule(11, 8)
    assert schedule(11, 8) != schedule(12, 8)
    assert not any(f.kind.endswith("-cut") for f in schedule(11, 40, network_cuts=False))


RANDOMIZED = drawn(["postgres-two-phase-commit", "kafka-transactional"], "ONCEKIT_RANDOMIZED_RUNS")
"""The randomized campaign's pipelines: one in ``make test`` (drawn from the run's seed, about
110 s each with 3 faults), both in ``make test-long`` with 100 faults each."""


@pytest.mark.long(900)
@pytest.mark.parametrize("pipeline", RANDOMIZED)
def test_randomized_campaign_every_fault_exactly_once(services: Services, pipeline: str,
                                                      campaign_tables: list[str]) -> None:
    upstream = Upstream(duplicates=0.02, malformed=0.01, late=0.02, seed=SEED)
    report = run_campaign(pipeline, services, FAULTS, SEED, upstream=upstream)
    text = record(report, pipeline, campaign_tables)
    assert report.passed, text
    assert [r.verdict for r in report.results] == ["exactly-once"] * FAULTS, text
    assert not any(r.stalled for r in report.results), text  # live: every fault caught up within the window
    assert sum(r.fired for r in report.results) >= FAULTS * 0.8, text  # the faults really happened


@pytest.mark.long(250)
def test_fanout_campaign_one_query_two_sinks_each_exactly_once_and_live(services: Services,
                                                                       campaign_tables: list[str]) -> None:
    """One query writes every record to a table (two-phase commit) and a topic (transactional)
    through one checkpoint; each target is compared with the input on its own. The faults hit
    running batches: the broker killed -9 and PostgreSQL killed -9 (``make test-long``: the
    broker stopped too, after which this pipeline once sat with a planned batch for minutes,
    before the kit's markers left consumer groups). Driver kills and crashes between the targets' commits are the
    20-fault campaigns' (a restarted driver costs a minute of this run)."""
    faults = [Fault("kafka-kill", delay_s=0.5, outage_s=3), Fault("postgres-kill", delay_s=0.5, outage_s=2)]
    if full_size():  # make test-long: the broker stopped too, for a short and a longer outage
        faults += [Fault("kafka-restart", delay_s=0.5, outage_s=3), Fault("kafka-restart", delay_s=1.0, outage_s=6)]
    report = run_campaign("fan-out-postgres-kafka", services, faults, SEED)
    text = record(report, "fan-out-postgres-kafka", campaign_tables)
    assert report.passed, text
    assert [r.verdict for r in report.results] == ["exactly-once"] * len(faults), text
    assert not any(r.stalled for r in report.results), text
    assert all(r.fired for r in report.results), text


@pytest.mark.long(60)
def test_oncekit_verify_as_a_new_user(tmp_path: Path) -> None:
    """``oncekit verify`` as a new user runs it from the verifying page (1 fault of its 20): it
    starts its own services, prints progress and the table, writes JSON; every verdict
    exactly-once."""
    env = {k: v for k, v in os.environ.items() if k != "ONCEKIT_CRASH_DIR"}
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    (command,) = console_commands("verify", {"--faults 20": "--faults 1", "--json report.json": "--backend "
                                             f"{os.environ.get('ONCEKIT_TEST_BACKEND', 'auto')} --json verify.json"})
    out = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=900, cwd=tmp_path, env=env)
    REPORTS.mkdir(parents=True, exist_ok=True)
    (REPORTS / "oncekit-verify-cli.out").write_text(out.stdout + out.stderr)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    rows = [line for line in out.stdout.splitlines() if re.match(r"\|\s+\d+ \|", line)]
    assert len(rows) == 1 and all("exactly-once" in row for row in rows), out.stdout
    assert "left behind: nothing" in out.stdout and (tmp_path / "verify.json").exists(), out.stdout


def on_standalone_cluster(faults: list[Fault], name: str, services: Services, spark_cluster: StandaloneCluster,
                          campaign_tables: list[str]) -> None:
    """A user's pipeline (module:function) on a standalone cluster, where executors are JVMs of
    their own with their own Python workers, through ``faults``: each fires and ends exactly-once."""
    report = run_campaign("tests.eos.user_pipeline:start", services, faults, seed=0, spark_cluster=spark_cluster,
                          env={"SPARK_MASTER": spark_cluster.url, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    text = record(report, name, campaign_tables)
    assert report.passed and all(r.fired for r in report.results), text
    assert [r.verdict for r in report.results] == ["exactly-once"] * len(faults), text


@pytest.mark.long(200)
def test_user_pipeline_on_standalone_cluster(services: Services, spark_cluster: StandaloneCluster,
                                             campaign_tables: list[str]) -> None:
    """What only a cluster does: a driver kill loses the driver and its application, an executor
    killed -9 during a batch is replaced by the worker and its tasks run again."""
    on_standalone_cluster([Fault("kill", delay_s=2.0), Fault("spark-executor-kill")],
                          "user-pipeline-standalone-cluster", services, spark_cluster, campaign_tables)


@pytest.mark.full_size
@pytest.mark.long(200)
def test_user_pipeline_on_standalone_cluster_crash_points(services: Services, spark_cluster: StandaloneCluster,
                                                          campaign_tables: list[str]) -> None:
    """A task crash is retried on the executor; a driver crash in its commit and after its journal
    restarts the query on the cluster (the crash-point tests run all three in local mode in
    ``make test``, and the spark-submit test a driver crash on this cluster)."""
    on_standalone_cluster([Fault("crash", "task_after_pre_commit"), Fault("crash", "driver_after_journal"),
                           Fault("crash", "mid_commit")],
                          "user-pipeline-standalone-cluster-crash-points", services, spark_cluster, campaign_tables)


# -- known-bad configurations: the checker must catch each --------------------------------------

@pytest.mark.parametrize("pipeline", ["kafka-at-least-once"])
def test_checker_catches_at_least_once_duplicates(services: Services, pipeline: str, campaign_tables: list[str]) -> None:
    """Every task wrote and committed, then the driver's commit failed: the restarted query runs
    the batch again and writes its rows again. Spark's own Kafka sink is at-least-once, the case
    the kit exists for; the same check on a table took another 80 s of CI for no new path of the
    checker's (it compares ids, whichever system held them)."""
    report = run_campaign(pipeline, services, [Fault("crash", "driver_after_journal")], guarantee="exactly-once")
    text = record(report, pipeline, campaign_tables)
    assert report.results[0].fired and report.results[0].verdict == "duplicates", text
    assert not report.passed, text


@pytest.mark.long(80)
def test_checker_catches_at_most_once_loss(services: Services, campaign_tables: list[str]) -> None:
    """A pipeline restarted without its checkpoint (from the latest offsets) skips what the
    killed driver had not written: loss, and no duplicate."""
    report = run_campaign("postgres-at-most-once", services, [Fault("kill", delay_s=0.1)], guarantee="exactly-once")
    text = record(report, "postgres-at-most-once", campaign_tables)
    assert report.results[0].fired and report.results[0].verdict == "LOSS", text
    assert not report.passed, text
