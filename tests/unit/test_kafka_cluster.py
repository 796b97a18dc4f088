"""A three-broker cluster's settings and the broker faults' schedule, without services."""

from __future__ import annotations

import pytest

from oncekit.connectors.kafka_broker import BrokerAddress, broker_properties
from oncekit.core.errors import ConfigError
from oncekit.verify import Fault, schedule
from oncekit.verify.faults import CLUSTER_FAULTS, KAFKA_CLUSTER_FAULTS


def test_broker_properties_single_broker_replicates_once() -> None:
    node = BrokerAddress(1, 9092, 9093)
    properties = broker_properties(node)
    assert properties["controller.quorum.voters"] == "1@127.0.0.1:9093"
    assert properties["advertised.listeners"] == "PLAINTEXT://127.0.0.1:9092"
    assert properties["inter.broker.listener.name"] == "PLAINTEXT"
    for key in ("default.replication.factor", "offsets.topic.replication.factor",
                "transaction.state.log.replication.factor", "min.insync.replicas", "transaction.state.log.min.isr"):
        assert properties[key] == "1", key


def test_broker_properties_three_brokers_replicate_three_times_with_min_isr_two() -> None:
    nodes = [BrokerAddress(i, 9000 + i, 9093, host=f"broker-{i}", internal_port=9094) for i in (1, 2, 3)]
    properties = broker_properties(nodes[1], nodes, bind_host="0.0.0.0")
    assert properties["node.id"] == "2"
    assert properties["controller.quorum.voters"] == "1@broker-1:9093,2@broker-2:9093,3@broker-3:9093"
    # clients on the host reach the broker on its own port; the others on its container name
    assert properties["advertised.listeners"] == "PLAINTEXT://127.0.0.1:9002,INTERNAL://broker-2:9094"
    assert properties["listeners"] == "PLAINTEXT://0.0.0.0:9002,CONTROLLER://0.0.0.0:9093,INTERNAL://0.0.0.0:9094"
    assert properties["inter.broker.listener.name"] == "INTERNAL"
    assert properties["default.replication.factor"] == properties["offsets.topic.replication.factor"] == "3"
    assert properties["transaction.state.log.replication.factor"] == "3"
    assert properties["min.insync.replicas"] == properties["transaction.state.log.min.isr"] == "2"
    assert properties["unclean.leader.election.enable"] == "false"


def test_broker_properties_two_brokers_refused() -> None:
    nodes = [BrokerAddress(1, 9001, 9101), BrokerAddress(2, 9002, 9102)]
    with pytest.raises(ConfigError, match="3 or more"):
        broker_properties(nodes[0], nodes)


def test_schedule_on_kafka_cluster_draws_broker_faults_reproducibly() -> None:
    faults = schedule(2026, 40, kafka_cluster=True)
    assert faults == schedule(2026, 40, kafka_cluster=True)
    assert {f.kind for f in faults} & set(KAFKA_CLUSTER_FAULTS)
    assert all(3 <= f.outage_s <= 15 for f in faults if f.kind in KAFKA_CLUSTER_FAULTS)
    assert not any(f.kind == "kafka-broker-cut" for f in schedule(2026, 80, network_cuts=False, kafka_cluster=True))
    assert not any(f.kind in CLUSTER_FAULTS for f in schedule(2026, 80))  # one broker: as before


def test_cluster_fault_names_say_what_was_hit() -> None:
    assert str(Fault("kafka-leader-kill", outage_s=8)) == "kafka kill -9 partition leader 8 s"
    assert str(Fault("kafka-rolling-restart")) == "kafka rolling restart of all brokers"
    assert str(Fault("spark-executor-kill")) == "spark kill -9 executor mid-batch"
