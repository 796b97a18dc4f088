"""The status page in a real browser: Debian's chromium, driven by Playwright, opens the page of
a running pipeline (the PostgreSQL two-phase-commit example) on the real services, sees the completed batch count rise, sees a prepared
transaction and a Kafka transaction left open on purpose shown in red with their age, checks
/metrics against the checkpoint and the server, and saves a screenshot under .oncekit/."""

from __future__ import annotations

import contextlib
import re
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.request import urlopen

import psycopg
import pytest
from confluent_kafka import KafkaException, Producer

from oncekit.connectors import KafkaConfig
from oncekit.connectors.kafka import create_topic
from oncekit.core.names import TransactionId
from oncekit.core.spark.query import start_query
from oncekit.core.spark_log import SparkLog
from oncekit.status.app import StatusServer, StatusService
from oncekit.status.command import protocols_of
from oncekit.status.model import StatusCollector, Thresholds, Watched
from oncekit.status.services import collector_sources
from oncekit.verify import produce_input
from oncekit.verify.examples import example_frame, example_sink

pytestmark = [pytest.mark.services, pytest.mark.spark]

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SCREENSHOT = Path(__file__).resolve().parents[2] / ".oncekit" / "status-page.png"
TIMEOUT_S = 3.0  # the page's transaction timeout: the leftovers turn red after it
PER_BATCH = 200
EXAMPLE = "postgres-two-phase-commit"  # the lightest example with prepared transactions of its own


def _metric(text: str, name: str, **labels: str) -> float | None:
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith(f"{name}{{{wanted}}} " if labels else f"{name} "):
            return float(line.rsplit(" ", 1)[1])
    return None


def _abort(producer: Producer) -> None:
    with contextlib.suppress(KafkaException):  # already aborted if the broker's timeout passed
        producer.abort_transaction(30)


def test_status_page_in_chromium_shows_progress_and_red_leftovers(
    spark: Any, kafka: KafkaConfig, postgres_dsn: str, topic: str, unique_name: str, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from playwright.sync_api import expect, sync_playwright

    started = time.monotonic()
    produce_input(kafka, topic, 2 * PER_BATCH)
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {unique_name} (id int NOT NULL, payload text NOT NULL)")
        conn.execute(f"CREATE TABLE {unique_name}_held (id int)")
    create_topic(kafka, unique_name, partitions=2)  # where the transaction below is left open
    sink = example_sink(EXAMPLE, kafka, postgres_dsn, unique_name)
    checkpoint = str(tmp_path / "checkpoint")
    query = start_query(example_frame(EXAMPLE, spark, kafka, topic, PER_BATCH), sink, checkpoint,
                        trigger={"processingTime": "500 milliseconds"})
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(query.stop)
        # Left on purpose: a prepared transaction under a kit-format id of a sink no running query
        # owns (the query's recovery would abort one of its own), holding a lock on a table; and a
        # Kafka transaction left open on the topic made above.
        gid = str(TransactionId(f"pg-{unique_name}-left", 7, 0, 1))
        holder = psycopg.connect(postgres_dsn, autocommit=True)
        cleanup.callback(holder.close)
        holder.execute("BEGIN")
        holder.execute(f"INSERT INTO {unique_name}_held VALUES (1)")
        holder.execute(f"PREPARE TRANSACTION '{gid}'")
        cleanup.callback(holder.execute, f"ROLLBACK PREPARED '{gid}'")
        hanging = Producer({"bootstrap.servers": kafka.bootstrap_servers,
                            "transactional.id": f"left-open-{uuid.uuid4().hex[:8]}", "transaction.timeout.ms": 300_000})
        hanging.init_transactions(30)
        hanging.begin_transaction()
        cleanup.callback(_abort, hanging)
        hanging.produce(unique_name, b"never committed", partition=0)
        hanging.flush(10)

        collector = StatusCollector([Watched("pipeline", checkpoint, protocols_of(sink))],
                                    Thresholds(transaction_timeout_s=TIMEOUT_S),
                                    **collector_sources(kafka.bootstrap_servers, postgres_dsn))
        server = StatusServer(StatusService(collector, refresh_s=1.0, kafka_transactions_every_s=5.0), port=0).start()
        cleanup.callback(server.stop)
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
            page = browser.new_page(viewport={"width": 1280, "height": 1500})
            page.goto(server.url)
            completed = page.locator("[data-testid=completed-batches] b")

            def shown_above(count: int, timeout_s: float) -> int:
                """The page's completed batch count once it exceeds ``count``; fails at once with the
                query's own error if the query dies meanwhile."""
                deadline = time.monotonic() + timeout_s
                while time.monotonic() < deadline:
                    if not query.isActive:
                        raise AssertionError(f"the pipeline stopped: {query.exception()}")
                    text = completed.inner_text()
                    if text.isdigit() and int(text) > count:
                        return int(text)
                    page.wait_for_timeout(250)
                raise AssertionError(f"the page still shows {completed.inner_text()} completed batches after {timeout_s} s")

            first = shown_above(0, 120)
            print(f"status page: {first} batches completed after {time.monotonic() - started:.0f} s", flush=True)
            produce_input(kafka, topic, 2 * PER_BATCH, first=2 * PER_BATCH)
            shown_above(first, 60)
            print(f"status page: the count rose after {time.monotonic() - started:.0f} s", flush=True)
            row = page.locator(f'tr.prepared[data-gid="{gid}"]')
            expect(row).to_have_class(re.compile(r"\bred\b"), timeout=30_000)
            assert re.fullmatch(r"\d+\.\d (s|min)", row.locator("td.age").inner_text())
            assert f"{unique_name}_held" in row.inner_text()
            open_row = page.locator("tr.kafka-transaction.red")
            expect(open_row.first).to_be_visible(timeout=30_000)
            expect(page.locator("#verdict")).to_have_text(re.compile("AT RISK"))
            expect(page.locator("[data-testid=duration-chart] canvas").first).to_be_visible()

            # /metrics must say what the checkpoint says (retried: a batch may complete between the two reads).
            deadline = time.monotonic() + 30
            while True:
                completed_in_log = SparkLog(checkpoint).latest_completed()
                with urlopen(server.url + "metrics", timeout=10) as response:
                    text = response.read().decode()
                if _metric(text, "oncekit_last_completed_batch", query="pipeline") == completed_in_log \
                        or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            assert _metric(text, "oncekit_last_completed_batch", query="pipeline") == completed_in_log
            assert _metric(text, "oncekit_completed_batches", query="pipeline") == len(SparkLog(checkpoint).completed())
            assert _metric(text, "oncekit_prepared_transactions", sink=f"pg-{unique_name}-left") == 1
            assert (_metric(text, "oncekit_open_kafka_transactions") or 0) >= 1
            assert _metric(text, "oncekit_exactly_once_at_risk") == 1

            page.wait_for_timeout(1500)  # one more refresh, so the charts hold the newest batches
            SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(SCREENSHOT), full_page=True)
            browser.close()
        with capsys.disabled():  # on the terminal, also without -s
            print(f"\nstatus page screenshot: {SCREENSHOT} (test took {time.monotonic() - started:.0f} s)")
