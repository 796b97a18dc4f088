"""A three-broker KRaft cluster (replication factor 3, ``min.insync.replicas`` 2, no unclean
leader election) and the faults that hit one of its brokers: the leader of an output partition
killed -9, the transaction coordinator killed -9 while the sink commits, a rolling restart, a
broker cut off the network. The cluster is started once for the module, beside the session's
single broker; the campaign uses it with the session's PostgreSQL.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka.admin import AdminClient

from oncekit.connectors import KafkaConfig, Services
from oncekit.connectors.kafka_admin import broker_settings, create_topic
from oncekit.connectors.services import start_kafka
from oncekit.connectors.wait import wait_until
from oncekit.verify import Fault, run_campaign
from tests.eos.test_verify_campaign import record
from tests.sizes import full_size

pytestmark = [pytest.mark.services]

BACKEND = os.environ.get("ONCEKIT_TEST_BACKEND", "auto")


@pytest.fixture(scope="module")
def cluster(services: Services) -> Iterator[Services]:
    kafka = start_kafka(BACKEND, brokers=3)
    try:
        yield Services(services.backend, kafka, services.postgres)
    finally:
        kafka.remove()


def test_three_brokers_replicate_as_production(cluster: Services, unique_name: str) -> None:
    config = KafkaConfig(cluster.kafka.bootstrap_servers)
    settings = broker_settings(config)
    assert {key: settings[key] for key in ("default.replication.factor", "min.insync.replicas",
                                           "transaction.state.log.replication.factor", "transaction.state.log.min.isr",
                                           "unclean.leader.election.enable")} == {
        "default.replication.factor": "3", "min.insync.replicas": "2", "transaction.state.log.replication.factor": "3",
        "transaction.state.log.min.isr": "2", "unclean.leader.election.enable": "false"}
    topic = unique_name.replace("_", "-")
    create_topic(config, topic, partitions=2)  # the kit's default: the cluster's replication factor
    metadata = AdminClient(config.settings()).list_topics(timeout=30)
    assert sorted(b for b in metadata.brokers) == [1, 2, 3]
    for name in (topic, "__transaction_state"):
        assert {len(p.replicas) for p in metadata.topics[name].partitions.values()} == {3}, name


@pytest.mark.long(250)
def test_campaign_one_broker_at_a_time_exactly_once(cluster: Services, campaign_tables: list[str]) -> None:
    """The transactional Kafka sink under broker faults, each once (``make test``: a leader and the
    transaction coordinator killed; ``make test-long``: a broker cut off and a rolling restart
    too); every verdict exactly-once,
    nothing left open. The coordinator kill finds its broker with Kafka's DescribeTransactions
    (the report's detail names it)."""
    # Short outages: a killed broker is down for its restart as well (10-20 s in all, past the
    # 9 s broker session timeout, so leadership moves); the cut lasts past that timeout too.
    faults = [Fault("kafka-leader-kill", delay_s=0.5, outage_s=3), Fault("kafka-coordinator-kill", outage_s=3)]
    if full_size():  # make test-long: a network cut and a rolling restart too
        faults += [Fault("kafka-broker-cut", delay_s=0.5, outage_s=12), Fault("kafka-rolling-restart", delay_s=0.5)]
    report = run_campaign("kafka-transactional", cluster, faults, seed=0)
    text = record(report, "kafka-transactional-three-brokers", campaign_tables)
    assert report.passed and all(r.fired for r in report.results), text
    assert [r.verdict for r in report.results] == ["exactly-once"] * len(faults), text


@pytest.mark.long(55)
def test_local_backend_three_brokers(unique_name: str) -> None:
    """The local backend's cluster: three broker JVMs on loopback, all in the metadata, a topic
    replicated on all three."""
    kafka = start_kafka("local", brokers=3)
    try:
        config = KafkaConfig(kafka.bootstrap_servers)
        topic = unique_name.replace("_", "-")
        create_topic(config, topic, partitions=2)
        admin = AdminClient(config.settings())
        listed: list[Any] = []

        def lists_topic() -> None:
            # create_topic saw the topic on one broker; another may apply the metadata log later
            listed[:] = [admin.list_topics(timeout=30)]
            if topic not in listed[0].topics:
                raise LookupError(f"topic {topic} not listed yet")

        wait_until(lists_topic, 30, f"topic {topic} in the metadata")
        metadata = listed[0]
        assert sorted(metadata.brokers) == [1, 2, 3]
        assert {len(p.replicas) for p in metadata.topics[topic].partitions.values()} == {3}
    finally:
        kafka.remove()


def test_cli_services_up_two_brokers_refused(tmp_path: Path) -> None:
    """``oncekit services up --brokers 2`` says what to run instead and starts nothing."""
    env = {**os.environ, "ONCEKIT_STATE_DIR": str(tmp_path)}
    up = subprocess.run([sys.executable, "-m", "oncekit.cli", "services", "up", "--backend", "local", "--brokers", "2"],
                        env=env, capture_output=True, text=True, timeout=120, check=False)
    assert up.returncode != 0 and "3 or more" in up.stdout + up.stderr, up.stdout + up.stderr
    assert not (tmp_path / "services.json").exists()
