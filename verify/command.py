"""``oncekit verify``: start services, run one campaign with a progress line per fault, print the
table (and write JSON), and say how to reproduce a failure; or, with ``--soak``, one soak with a
row every few minutes. Called by the CLI only."""

from __future__ import annotations

import json
from pathlib import Path

from oncekit.connectors.services import start_services
from oncekit.verify.as_written import job_records
from oncekit.verify.campaign import run_campaign
from oncekit.verify.io import Upstream
from oncekit.verify.report import FaultResult, table, write_json
from oncekit.verify.soak import HEADER, SoakSample, parse_duration, report_dict, row, run_soak
from oncekit.verify.soak import periodic_faults as periodic_faults_of
from oncekit.verify.soak import table as soak_table


def main(pipeline: str, faults: int, seed: int, guarantee: str | None, backend: str, duplicates: float,
         malformed: float, late: float, json_path: str | None, brokers: int = 1, secured: bool = False,
         services_only: bool = False, input_path: str | None = None) -> int:
    """Returns the exit code: 0 when every verdict meets the guarantee and nothing stalled.
    ``brokers``: a Kafka cluster of that many brokers (3: the schedule adds the broker faults);
    ``services_only``: service faults only; ``input_path``: a job as written's input
    (:func:`~oncekit.verify.as_written.job_records`)."""
    records = job_records(pipeline, input_path)

    def progress(done: int, total: int, result: FaultResult) -> None:
        bar = "#" * (20 * done // total)
        print(f"[{bar:<20}] {done}/{total} {result.fault}: {result.verdict}{', STALLED' if result.stalled else ''} "
              f"(batch {result.batch}, next commit {result.next_commit_s:.1f} s, recovery {result.recovery_s:.1f} s)",
              flush=True)

    started = start_services(backend, kafka_brokers=brokers, secured=secured)
    print(f"services ({started.backend}, {brokers} Kafka broker{'s' if brokers > 1 else ''}) ready; "
          f"{faults} faults into {pipeline}, seed {seed}", flush=True)
    with started.running() as services:
        upstream = Upstream(duplicates, malformed, late, seed)
        report = run_campaign(pipeline, services, faults, seed, guarantee, progress, upstream=upstream,
                              services_only=services_only, records=records, notes=lambda line: print(line, flush=True))
    print(table(report))
    if json_path:
        write_json(json_path, report)
    if not report.passed:
        given = f" --input {input_path}" if input_path else ""
        print(f"not {report.guarantee} and live; reproduce with: oncekit verify --pipeline {pipeline}{given} "
              f"--faults {faults} --seed {seed} --duplicates {duplicates} --malformed {malformed} "
              f"--late {late} --brokers {brokers}{' --service-faults' if services_only else ''}  "
              f"(schedule: {'; '.join(r.fault for r in report.results)})")
        return 1
    return 0


def soak(pipeline: str, duration: str, seed: int, backend: str, rate: float, fault_every_s: float,
         sample_every_s: float, json_path: str | None, periodic_faults: str = "") -> int:
    """``oncekit verify --soak DURATION``; returns 0 when the output is exactly-once, nothing is
    left behind, nothing stalled and everything bounded stayed within its bound."""
    seconds = parse_duration(duration)
    periodic = periodic_faults_of(periodic_faults)
    started = start_services(backend)
    faults = (", ".join(f"{fault} every {every:.0f} s" for every, fault in periodic) if periodic
              else f"a fault every {fault_every_s:.0f} s")
    print(f"services ({started.backend}) ready; soaking {pipeline} for {seconds / 60:.1f} min at {rate:g} records/s, "
          f"{faults}, seed {seed}", flush=True)
    print(HEADER, flush=True)

    def progress(sample: SoakSample) -> None:
        print(row(sample), flush=True)

    with started.running() as services:
        report = run_soak(pipeline, services, seconds, seed, rate, fault_every_s, sample_every_s, progress=progress,
                          periodic=periodic)
    print(soak_table(report))
    if json_path:
        Path(json_path).write_text(json.dumps(report_dict(report), indent=2))
    return 0 if report.passed else 1


def lifecycle(backend: str, json_path: str | None) -> int:
    """``oncekit verify --lifecycle``: start a broker whose group offsets expire in a minute, run
    the lifecycle cases (:mod:`oncekit.verify.lifecycle`) in a Spark session of this process,
    print the table; 0 when every case ended as expected."""
    import os
    import tempfile

    from oncekit.connectors import KafkaConfig
    from oncekit.connectors.services import start_kafka
    from oncekit.core.crash import CRASH_DIR_ENV
    from oncekit.verify.lifecycle import BROKER_SETTINGS, Lifecycle, table

    work = Path(tempfile.mkdtemp(prefix="oncekit-lifecycle-"))
    crash_dir = work / "crash"
    crash_dir.mkdir()
    os.environ[CRASH_DIR_ENV] = str(crash_dir)  # before Spark starts its Python workers, which read it

    from oncekit.core.spark.session import spark_session

    kafka = start_kafka(backend, settings=BROKER_SETTINGS)
    print(f"broker at {kafka.bootstrap_servers} (offsets.retention.minutes=1) ready; lifecycle cases in {work}",
          flush=True)
    spark = spark_session("oncekit-lifecycle", master="local[2]")
    try:
        results = Lifecycle(spark, KafkaConfig(kafka.bootstrap_servers), work, crash_dir).run(
            lambda r: print(f"{r.case}: {'ok' if r.passed else 'FAILED'} ({r.seen})", flush=True))
    finally:
        spark.stop()
        kafka.remove()
    print(table(results))
    if json_path:
        Path(json_path).write_text(json.dumps([r.__dict__ for r in results], indent=2))
    return 0 if all(r.passed for r in results) else 1
