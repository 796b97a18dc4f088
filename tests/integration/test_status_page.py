"""The status page in a real browser: Debian's chromium, driven by Playwright.

- On a running pipeline (the PostgreSQL two-phase-commit example) on the real services: the
  page sees the completed batch count rise, shows a prepared transaction and a Kafka transaction
  left open on purpose in red with their age, and /metrics agrees with the checkpoint and the
  server; a screenshot is saved under .oncekit/.
- On a fan-out checkpoint written by hand, with fake end offsets and no services (a few
  seconds): the lag chart's one sample spans a minute of clock times and its y labels fit beside
  the plot, and the fan-out's two-phase-commit and write-ahead-log targets show the driver
  committing them on checkpoint-complete, not their tasks.
"""

from __future__ import annotations

import contextlib
import json
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
from oncekit.connectors.kafka_admin import create_topic
from oncekit.core.journal import Journal
from oncekit.core.names import StagedFile, TransactionId
from oncekit.core.protocol import Committable
from oncekit.core.spark.query import Trigger, start_query
from oncekit.core.spark_log import SparkLog
from oncekit.status.app import StatusServer, StatusService
from oncekit.status.collector import StatusCollector, Watched
from oncekit.status.command import protocols_of
from oncekit.status.services import collector_sources
from oncekit.status.snapshot import Thresholds
from oncekit.verify import produce_input
from oncekit.verify.examples import example_frame, example_sink

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SCREENSHOT = Path(__file__).resolve().parents[2] / ".oncekit" / "status-page.png"
MONITORING = Path(__file__).resolve().parents[2] / "status" / "monitoring"  # alerts.yml, dashboard.json
FAN_OUT_SCREENSHOT = SCREENSHOT.with_name("status-page-fan-out.png")
CLOCK_TICKS = re.compile(r'^\["\d{2}:\d{2}:\d{2}"(,"\d{2}:\d{2}:\d{2}")*\]$')  # data-x-ticks: JSON of clock times
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


@pytest.mark.services
@pytest.mark.spark
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
                        trigger=Trigger(processing_time="500 milliseconds"))
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
                                    **collector_sources(kafka, postgres_dsn))
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
            expect(page.locator("[data-testid=lag-chart] .uplot").first).to_have_attribute("data-x-ticks", CLOCK_TICKS)

            # /metrics must say what the checkpoint says (retried: a batch may complete between the two reads).
            deadline = time.monotonic() + 30
            while True:
                in_log = SparkLog(checkpoint).completed()  # one read for both figures
                with urlopen(server.url + "metrics", timeout=10) as response:
                    text = response.read().decode()
                said = (_metric(text, "oncekit_last_completed_batch", query="pipeline"),
                        _metric(text, "oncekit_completed_batches", query="pipeline"))
                if said == (max(in_log), len(in_log)) or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            assert said == (max(in_log), len(in_log)), f"/metrics says {said}, the commit log {sorted(in_log)}"
            assert _metric(text, "oncekit_prepared_transactions", sink=f"pg-{unique_name}-left") == 1
            assert (_metric(text, "oncekit_open_kafka_transactions") or 0) >= 1
            assert _metric(text, "oncekit_exactly_once_at_risk") == 1
            # The alert rules and the dashboard the kit ships name only metrics a running query has.
            named = set(re.findall(r"\boncekit_[a-z_]+", "".join(p.read_text() for p in MONITORING.iterdir())))
            exposed = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line.startswith("oncekit_")}
            assert len(named) >= 15 and named <= exposed, f"not on /metrics: {sorted(named - exposed)}"

            page.wait_for_timeout(1500)  # one more refresh, so the charts hold the newest batches
            SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(SCREENSHOT), full_page=True)
            browser.close()
        with capsys.disabled():  # on the terminal, also without -s
            print(f"\nstatus page screenshot: {SCREENSHOT} (test took {time.monotonic() - started:.0f} s)")


FAN_OUT, TWO_PHASE, IDLE, STAGED, IN_TASK = "fanout-page", "pg-balances", "pg-idle", "kafka-staged", "kafka-updates"
LAG = 21_000  # wider than uPlot's default 50 px y axis has room for as "21,000"
UPLOT_TICK_AND_GAP_PX = 10 + 5  # uPlot's defaults: a label ends this far left of the plot


def _fan_out_checkpoint(root: Path) -> None:
    """Two complete batches of a fan-out, written as Spark and the engine write them: batch 0
    committed (one two-phase-commit committable, 5 rows), batch 1 journaled with a two-phase-commit
    and a write-ahead-log committable and not yet committed. Batch 1 ends at offset 1,000 of
    payments-0. The write-ahead-log target and the idle two-phase-commit one (no rows routed to
    it) have committed nothing yet."""
    for batch, end in ((0, 500), (1, 1_000)):
        meta = json.dumps({"batchWatermarkMs": 0, "batchTimestampMs": int(time.time() * 1000), "conf": {}})
        (root / "offsets").mkdir(parents=True, exist_ok=True)
        (root / "offsets" / str(batch)).write_text(f"v1\n{meta}\n{json.dumps({'payments': {'0': end}})}")
        (root / "commits").mkdir(parents=True, exist_ok=True)
        (root / "commits" / str(batch)).write_text('v1\n{"nextBatchWatermarkMs":0}')
    journal = Journal(str(root), FAN_OUT)
    journal.write(0, [Committable(TWO_PHASE, 0, 0, 1, 5, transaction_id=str(TransactionId(TWO_PHASE, 0, 0, 1)))])
    journal.mark_done(0)
    journal.write(1, [Committable(TWO_PHASE, 1, 0, 2, 4, transaction_id=str(TransactionId(TWO_PHASE, 1, 0, 2))),
                      Committable(STAGED, 1, 0, 2, 3, staged_file=str(StagedFile(1, 0, 2)))])


def _count(label: str) -> float:
    """A y tick label of the page's short form back to a number: "21k" 21,000, "1.5M", "2,500"."""
    match = re.fullmatch(r"([\d.,]+)([kMG]?)", label)
    assert match is not None, f"not a count: {label!r}"
    return float(match[1].replace(",", "")) * {"": 1, "k": 1e3, "M": 1e6, "G": 1e9}[match[2]]


def test_status_page_in_chromium_lag_chart_of_one_sample_and_fan_out_commit_modes(tmp_path: Path) -> None:
    from playwright.sync_api import expect, sync_playwright

    checkpoint = tmp_path / "checkpoint"
    _fan_out_checkpoint(checkpoint)
    protocols = {FAN_OUT: "fan-out", TWO_PHASE: "two-phase-commit", IDLE: "two-phase-commit",
                 STAGED: "write-ahead-log", IN_TASK: "transactional"}
    collector = StatusCollector([Watched("fanout", str(checkpoint), protocols)],
                                end_offsets=lambda wanted: {("payments", 0): (1_000 + LAG, 1_000 + LAG)})
    # One snapshot for the whole test (the next refresh is an hour away): the lag chart has one sample.
    with contextlib.ExitStack() as cleanup:
        server = StatusServer(StatusService(collector, refresh_s=3600.0), port=0).start()
        cleanup.callback(server.stop)
        with urlopen(server.url + "api/status", timeout=10) as response:
            taken_at = float(json.loads(response.read())["taken_at"])
        playwright = cleanup.enter_context(sync_playwright())
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        cleanup.callback(browser.close)
        page = browser.new_page(viewport={"width": 1280, "height": 1200})
        page.goto(server.url)

        chart = page.locator("[data-testid=lag-chart] .uplot")
        expect(chart).to_have_attribute("data-y-ticks", re.compile(r"^\[.+\]$"), timeout=30_000)
        page.wait_for_timeout(2500)  # one more poll: the chart redrawn with the same single sample
        x_ticks = json.loads(chart.get_attribute("data-x-ticks") or "[]")
        x_min, x_max = float(chart.get_attribute("data-x-min") or "nan"), float(chart.get_attribute("data-x-max") or "nan")
        assert x_ticks and all(re.fullmatch(r"\d{2}:\d{2}:\d{2}", tick) for tick in x_ticks), x_ticks
        assert 0 < x_max - x_min <= 3600 and abs(x_max - taken_at) <= 60, (x_min, x_max, taken_at)
        first, last = page.evaluate(
            "stamps => stamps.map(s => new Date(s * 1000).toTimeString().slice(0, 8))", [x_min, x_max])
        if first <= last:  # the window does not cross midnight: every label lies in it
            assert all(first <= tick <= last for tick in x_ticks), (first, x_ticks, last)

        y_ticks = json.loads(chart.get_attribute("data-y-ticks") or "[]")
        assert float(chart.get_attribute("data-y-max") or "nan") >= LAG  # the axis reaches the sample
        assert max(_count(tick) for tick in y_ticks) >= LAG / 2, y_ticks  # labels of its magnitude: 20k, not 1,000
        fit = chart.evaluate("""root => {
            const context = document.createElement("canvas").getContext("2d");
            context.font = root.dataset.axisFont;
            const labels = JSON.parse(root.dataset.yTicks);
            return {widest: Math.max(...labels.map(label => context.measureText(label).width)),
                    plotLeft: parseFloat(root.querySelector(".u-over").style.left)};
        }""")
        assert fit["widest"] + UPLOT_TICK_AND_GAP_PX <= fit["plotLeft"], (fit, y_ticks)  # no label cut at the left

        for target in (TWO_PHASE, IDLE, STAGED):
            row = page.locator(f'tr[data-target="{target}"]')
            expect(row).to_have_attribute("data-commit-mode", "checkpoint-complete")
            expect(row).to_contain_text("by the driver on checkpoint-complete")
            expect(row).not_to_contain_text("committed by its tasks")
        expect(page.locator(f'tr[data-target="{TWO_PHASE}"] td.committed')).to_have_text(
            "1 committable, 5 rows, by the driver on checkpoint-complete")
        expect(page.locator(f'tr[data-target="{IN_TASK}"]')).to_have_attribute("data-commit-mode", "task")
        expect(page.locator(f'tr[data-target="{IN_TASK}"] td.committed')).to_have_text("committed by its tasks")
        FAN_OUT_SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(FAN_OUT_SCREENSHOT), full_page=True)
