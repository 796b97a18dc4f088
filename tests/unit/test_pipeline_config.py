"""The pipeline config file: packaged defaults, a user's file, flag overrides, clear refusals."""

from __future__ import annotations

from pathlib import Path

import pytest

from oncekit.reference import config
from oncekit.core.errors import ConfigError
from oncekit.core.restart import ExponentialBackoff, FixedDelay


def test_pipeline_config_defaults_come_from_the_packaged_file() -> None:
    loaded = config.load()
    assert loaded.topics.payments == "payments" and loaded.guarantees.balances == "two-phase-commit"
    assert loaded.restart_strategy() == FixedDelay(attempts=3, delay_s=1)


def test_pipeline_config_file_then_flags_override(tmp_path: Path) -> None:
    path = tmp_path / "p.toml"
    path.write_text('[tables]\nbalances = "b2"\n[pipeline]\ncheckpoint = "/x"\n'
                    '[restart]\ntype = "exponential-backoff"\nattempts = 2\n')
    loaded = config.load(path, {"pipeline.checkpoint": "/y", "topics.partitions": None})
    assert loaded.tables.balances == "b2" and loaded.tables.late_events == "late_events"
    assert loaded.pipeline.checkpoint == "/y" and loaded.topics.partitions == 2
    assert loaded.restart_strategy() == ExponentialBackoff(attempts=2)


@pytest.mark.parametrize(("text", "message"), [
    ("[tables]\nbalance = 'x'\n", "unknown key"),
    ("[guarantees]\nminute_totals = 'at-least-once'\n", "minute_totals must be one of"),
    ("[restart]\ntype = 'sometimes'\n", "unknown type"),
    ("[guarantees]\nbalance_updates = 'at-least-once'\n", "balance_updates must be one of"),
    ("[pipeline]\nsource = 'jvm'\n", "source must be one of oncekit, spark"),
    ("[pipeline]\nmax_offsets_per_trigger = 'many'\n", "expected int"),
    ("[sinks]\nx = 1\n", "unknown table"),
    ("not toml [", "not valid TOML"),
])
def test_pipeline_config_mistakes_are_refused(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "p.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        config.load(path)


def test_pipeline_config_repr_hides_the_password() -> None:
    loaded = config.load(None, {"services.postgres_dsn": "postgresql://u:s3cret@h:5432/d"})
    assert "s3cret" not in repr(loaded)


def test_doctor_sizes_prepared_transactions_from_writer_partitions_targets_and_batches(tmp_path: Path) -> None:
    """Not from the topic's partitions: a stateful query writes as many partitions as its state
    has, to every two-phase-commit target, for each batch in flight."""
    from oncekit.doctor import prepared_wanted, target_from_config

    checkpoint = tmp_path / "checkpoint"
    (checkpoint / "pipeline" / "offsets").mkdir(parents=True)
    (checkpoint / "pipeline" / "offsets" / "4").write_text('v1\n{"conf": {"spark.sql.shuffle.partitions": "16"}}\n')
    loaded = config.load(None, {"pipeline.checkpoint": str(checkpoint)})
    assert prepared_wanted(target_from_config(loaded)) == (48, "16 writer partitions x 1 two-phase-commit targets x 3 batches in flight")
