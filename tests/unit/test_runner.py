"""``oncekit run``'s job names and restart flag (pure logic; the command itself runs in
tests/eos/test_run_command.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from oncekit.core.errors import ConfigError
from oncekit.core.restart import FixedDelay
from oncekit.runner import load_job, parse_restart


def test_a_job_file_names_its_function_or_start(tmp_path: Path) -> None:
    job = tmp_path / "job.py"
    job.write_text("def start(spark):\n    return 'started'\n\ndef other(spark):\n    return 'other'\n")
    assert load_job(str(job))(None) == "started"
    assert load_job(f"{job}:other")(None) == "other"


def test_a_job_that_cannot_be_loaded_is_refused_naming_what_is_missing(tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text("x = 1\n")
    with pytest.raises(ConfigError, match=r"has no function start\(spark\)"):
        load_job(str(tmp_path / "job.py"))
    with pytest.raises(ConfigError, match="no file"):
        load_job(str(tmp_path / "missing.py"))
    with pytest.raises(ConfigError, match="cannot import no_such_module"):
        load_job("no_such_module:start")


def test_the_restart_flag_is_a_strategy_table_on_one_line() -> None:
    assert parse_restart("fixed-delay:attempts=2,delay_s=0.5") == FixedDelay(attempts=2, delay_s=0.5)
    with pytest.raises(ConfigError, match="unknown type"):
        parse_restart("sometimes")
    with pytest.raises(ConfigError, match="is not key=value"):
        parse_restart("fixed-delay:attempts")


def test_a_standby_that_loses_the_race_to_take_over_goes_back_to_waiting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 46, finding 3: two standbys found the lease void together; this one's start was
    refused because the other holds the query now. It must wait again (and take over when the
    other dies), not use up its restarts and exit."""
    from oncekit import runner
    from oncekit.core.errors import LeaseHeldError

    waits: list[int] = []
    monkeypatch.setattr("oncekit.core.spark.standby.stand_by", lambda *args, **kwargs: waits.append(1))
    monkeypatch.setattr(runner, "spark_session", lambda *args, **kwargs: object())
    starts: list[int] = []

    def start(spark: Any) -> Any:
        starts.append(1)
        if len(starts) == 1:
            raise LeaseHeldError(f"the query checkpointed at {tmp_path} is running (driver pid 7 on other-host, lease "
                              "renewed 0 s ago); two drivers on one checkpoint would take turns fencing each other")
        raise _Finished()

    monkeypatch.setattr(runner, "load_job", lambda spec: start)
    with pytest.raises(_Finished):
        runner.run_job("job.py", restart="fixed-delay:attempts=3,delay_s=0", standby=[str(tmp_path)])
    assert len(waits) == 2 and len(starts) == 2


class _Finished(BaseException):
    """The second standby's job, once it took over (ends the test)."""


def test_oncekit_run_serves_its_status_page_on_the_host_it_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--ui`` listens on the loopback unless ``--host`` says another address (0.0.0.0 for a
    Prometheus on another host)."""
    from oncekit import cli, runner

    seen: list[tuple[Any, ...]] = []
    monkeypatch.setattr(runner, "run_job", lambda *args: seen.append(args) or 0)
    for argv, host in ((["run", "job.py", "--ui", "8765"], "127.0.0.1"),
                       (["run", "job.py", "--ui", "8765", "--host", "0.0.0.0"], "0.0.0.0")):
        args = cli.parser().parse_args(argv)
        assert args.run(args) == 0
        assert seen[-1][-2:] == (8765, host)


def test_a_job_run_from_its_own_file_restarts_as_oncekit_run_does(monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """``oncekit.run(start)`` (a job submitted with spark-submit) restarts the job under the
    strategy given as an object, and names the job by its function."""
    import oncekit
    from oncekit import runner
    from oncekit.core.errors import RestartsExhaustedError

    monkeypatch.setattr(runner, "spark_session", lambda *args, **kwargs: object())
    calls: list[int] = []

    def start(spark: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a transient failure")
        return "not a query"

    with pytest.raises(RestartsExhaustedError, match="job start: its function must return the queries it started"):
        oncekit.run(start, restart=oncekit.FixedDelay(attempts=2, delay_s=0))
    assert len(calls) == 3 and "job start failed (a transient failure); restart 1" in capsys.readouterr().out


def test_the_jobs_status_page_asks_the_services_of_its_source_and_sinks(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--ui`` finds Kafka and PostgreSQL in the job itself: the cluster its kit source reads
    from (else its Kafka sink's, client settings kept), its PostgreSQL sink's database; the
    environment only for what the job does not name."""
    from oncekit import fan_out, kafka_sink, postgres_sink
    from oncekit.connectors import kafka as kafka_connector
    from oncekit.runner import services_of

    monkeypatch.setattr(kafka_connector, "_clusters_read", {})
    monkeypatch.setenv("ONCEKIT_KAFKA_BOOTSTRAP", "from-env:9092")
    monkeypatch.setenv("ONCEKIT_POSTGRES_DSN", "postgresql://env@db/env")
    secured = {"security.protocol": "SASL_SSL", "sasl.mechanism": "PLAIN", "sasl.username": "u", "sasl.password": "p"}
    sink = fan_out({"table": postgres_sink("postgresql://u:p@db/jobs", "t"),
                    "topic": kafka_sink("sink-kafka:9092", "out", client=secured)})
    kafka, dsn = services_of([sink])
    assert kafka is not None and (kafka.bootstrap_servers, dict(kafka.client)) == ("sink-kafka:9092", secured)
    assert dsn == "postgresql://u:p@db/jobs"
    kafka_connector.remember_cluster_read(kafka_connector.KafkaConfig("source-kafka:9092", {"security.protocol": "SSL"}))
    kafka, _ = services_of([sink])
    assert kafka is not None and kafka.bootstrap_servers == "source-kafka:9092" and kafka.client == {"security.protocol": "SSL"}
    kafka, dsn = services_of([postgres_sink("postgresql://u:p@db/jobs", "t")])
    assert kafka is not None and kafka.bootstrap_servers == "source-kafka:9092"
    monkeypatch.setattr(kafka_connector, "_clusters_read", {})
    kafka, dsn = services_of([postgres_sink("postgresql://u:p@db/jobs", "t")])
    assert kafka is not None and kafka.bootstrap_servers == "from-env:9092" and dsn == "postgresql://u:p@db/jobs"
