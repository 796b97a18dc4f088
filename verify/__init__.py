"""Exactly-once verification: the multiset checker, the pipelines it runs, the fault campaign.
May import everything in oncekit; nothing in oncekit outside cli.py and tests imports verify/."""

from __future__ import annotations

from oncekit.core.errors import VerifyError
from oncekit.verify.campaign import CHUNK, Campaign, run_campaign
from oncekit.verify.checker import GUARANTEES, Verdict, compare
from oncekit.verify.driver import start_driver
from oncekit.verify.examples import (
    COUNT,
    EXAMPLES,
    PER_BATCH,
    Example,
    PipelineContext,
    example_frame,
    example_sink,
    integers,
    resolve,
    sink_kind,
    start_example,
)
from oncekit.verify.faults import SERVICE_FAULTS, Fault, schedule
from oncekit.verify.io import (
    KafkaOutput,
    Upstream,
    committed_output,
    prepare_target,
    prepared_transactions,
    produce_input,
    read_committed,
    table_ids,
)
from oncekit.verify.report import CampaignReport, FaultResult, table, write_json

__all__ = [
    "CHUNK", "COUNT", "EXAMPLES", "GUARANTEES", "PER_BATCH", "SERVICE_FAULTS",
    "Campaign", "CampaignReport", "Example", "Fault", "FaultResult", "KafkaOutput", "PipelineContext",
    "Upstream", "Verdict", "VerifyError",
    "committed_output", "compare", "example_frame", "example_sink", "integers", "prepare_target",
    "prepared_transactions", "produce_input", "read_committed", "resolve", "run_campaign", "schedule",
    "sink_kind", "start_driver", "start_example", "table", "table_ids", "write_json",
]
