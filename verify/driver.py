"""The driver process of a pipeline under test: started by the harness as
``python -m oncekit.verify '<spec json>'`` in a session of its own, watched, killed and restarted.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from oncekit.core.crash import CRASH_DIR_ENV
from oncekit.core.errors import VerifyError
from oncekit.core.spark_log import SparkLog
from oncekit.core.stacks import log_tail, process_stacks
from oncekit.verify.examples import PipelineContext, resolve

logger = logging.getLogger(__name__)

BATCH_TIMEOUT_S = 90.0
"""The batch deadline of a pipeline under test (``spark.oncekit.batchTimeoutSeconds``): a
stalled batch is stopped and restarted by the driver's restart strategy well within a
campaign's catch-up window."""


def start_driver(pipeline: str, ctx: PipelineContext, crash_dir: str, drain: bool = False,
                 log: Path | None = None, env: dict[str, str] | None = None,
                 standby: bool = False, prefix: tuple[str, ...] = (), as_written: bool = False) -> subprocess.Popen[bytes]:
    """Start the driver process of ``pipeline`` (``python -m oncekit.verify``) in a session of its
    own, so that SIGKILL takes it and its Spark JVM together, with crash points read from
    ``crash_dir``. ``drain``: run until the input is drained (availableNow), once, without
    restarts; else run until SIGTERM, restarting the query as a restart strategy would.
    ``standby``: start Spark, then wait until no other driver holds the query's lease
    (:func:`~oncekit.core.spark.standby.stand_by`) before running it. ``prefix``: a command the
    driver runs under (``unshare --pid --fork --mount-proc``: a driver in a pid namespace of its
    own, as in a container that shares the host's name). ``as_written``: ``pipeline`` is a job as
    written, ``start(spark)``, run with its services redirected to ``ctx``'s
    (:mod:`~oncekit.verify.as_written`)."""
    # Secrets (the DSN's password, Kafka's SASL settings) go by environment, not on the command line.
    spec = {"pipeline": pipeline, "context": {**asdict(ctx), "dsn": "", "kafka_client": {}}, "drain": drain,
            "standby": standby, "as_written": as_written}
    driver = uuid.uuid4().hex
    environment = {**os.environ, **(env or {}), CRASH_DIR_ENV: crash_dir, "ONCEKIT_VERIFY_DSN": ctx.dsn,
                   "ONCEKIT_VERIFY_KAFKA_CLIENT": json.dumps(ctx.kafka_client), DRIVER_ENV: driver}
    out = open(log, "ab") if log else subprocess.DEVNULL
    try:
        process = subprocess.Popen([*prefix, sys.executable, "-m", "oncekit.verify", json.dumps(spec)],
                                   env=environment, stdout=out, stderr=out, start_new_session=True)
        _drivers[process.pid] = driver
        return process
    finally:
        if log:
            out.close()  # type: ignore[union-attr]


LOG_TAIL_LINES = 12
"""How much of a driver's log an error about it quotes."""

DRIVER_ENV = "ONCEKIT_VERIFY_DRIVER"
"""Names a driver process in its timeline: under a prefix such as ``unshare --pid`` the process
the harness started is not the driver's own pid."""
_drivers: dict[int, str] = {}  # the harness's process pid -> the driver's name (DRIVER_ENV)


def main(spec_text: str) -> int:
    """The driver process: ``python -m oncekit.verify '<spec json>'``."""
    from oncekit.core.restart import ExponentialBackoff, supervise
    from oncekit.core.spark.query import BATCH_TIMEOUT_CONF
    from oncekit.core.spark.session import spark_session
    from oncekit.core.spark.standby import serve_as_standby
    from oncekit.sources.warm_up import WARM_UP_MODULES, analyze_for_warm_up

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    spec = json.loads(spec_text)
    context = {**spec["context"], "dsn": os.environ.get("ONCEKIT_VERIFY_DSN", ""),
               "kafka_client": json.loads(os.environ.get("ONCEKIT_VERIFY_KAFKA_CLIENT") or "{}")}
    if spec["drain"]:
        context["trigger"] = {"available_now": True}
    ctx = PipelineContext.from_dict(context)
    timeline = Timeline(ctx.checkpoint)
    timeline.note("process")
    if spec.get("as_written"):
        from oncekit.verify.as_written import install

        install(ctx)  # before the job's module is imported: its imports of the kit read the redirect
    build: Callable[[Any, PipelineContext], Any] = resolve(spec["pipeline"])
    if spec.get("as_written"):
        job: Callable[..., Any] = build
        build = lambda spark, ctx: job(spark)  # noqa: E731 - the job as written takes the session only
    # Spark retries a failed task (local[cores,maxFailures] in local mode; a cluster's own conf else).
    master = os.environ.get("SPARK_MASTER") or "local[2,4]"
    # The harness's executors run on this machine, in this interpreter, on a cluster as well; no UI.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    conf = {f"spark.executorEnv.{CRASH_DIR_ENV}": os.environ.get(CRASH_DIR_ENV, ""), BATCH_TIMEOUT_CONF: str(BATCH_TIMEOUT_S),
            "spark.ui.enabled": "false"}
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    restarts_file = Path(ctx.checkpoint + ".restarts")

    def run() -> None:
        # The session of each attempt: the same one in classic Spark; a new one when a Spark
        # Connect server went away (its client stops the session it had).
        spark = spark_session("oncekit-verify", master=master, conf=conf)
        timeline.note("session")
        query = build(spark, ctx)
        timeline.note("query")
        Path(ctx.checkpoint + ".started").touch()  # the harness waits for it before producing
        wait = getattr(query, "await_termination", None) or query.awaitTermination
        while not wait(0.5):
            if stopping.is_set():
                query.stop()
                return

    def note_restart(count: int, error: BaseException) -> None:
        with restarts_file.open("a") as f:
            f.write(f"{time.time()} {type(error).__name__}\n")

    strategy = ExponentialBackoff(initial_s=0.5, max_s=4.0, attempts=40)
    if spec["drain"]:
        run()
    elif spec["standby"]:  # SIGTERM ends a waiting standby at once
        def session() -> Any:
            started = spark_session("oncekit-verify", master=master, conf=conf)
            timeline.note("session")
            return started

        serve_as_standby(session, [ctx.checkpoint], run, strategy, warmed=lambda: timeline.note("warm"),
                         took_over=lambda: timeline.note("takeover"), on_restart=note_restart, modules=WARM_UP_MODULES,
                         analyze=analyze_for_warm_up)
    else:
        supervise(run, strategy, note_restart)
    spark_session("oncekit-verify", master=master, conf=conf).stop()
    return 0


class Timeline:
    """``<checkpoint>.timeline``: when each start of a driver process reached each step (a JSON
    line each: step, wall-clock time, pid); ``make bench``'s recovery group reads it beside
    Spark's logs. Steps: process (its main runs), session (Spark's session is up), query
    (the query started); a standby's warm (warmed up, waiting) and takeover (the lease is free)."""

    def __init__(self, checkpoint: str) -> None:
        self.path = Path(checkpoint + ".timeline")

    def note(self, step: str) -> None:
        """Append ``step``; never fails the driver (the folder may not exist yet: Spark makes the
        checkpoint's own at the query's start)."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a") as out:
                out.write(json.dumps({"step": step, "t": time.time(), "pid": os.getpid(),
                                      "driver": os.environ.get(DRIVER_ENV, "")}) + "\n")
        except OSError as exc:
            logger.warning("driver timeline %s: %s", self.path, exc)

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]


def times_reached(process: subprocess.Popen[bytes], checkpoint: str, step: str) -> int:
    """How often the driver ``process`` noted ``step`` in the timeline of ``checkpoint``
    (:class:`Timeline`): a standby that went back to waiting notes ``warm`` again."""
    driver = _drivers.get(process.pid)
    return sum(1 for e in Timeline(checkpoint).read()
               if e["step"] == step and (e.get("driver") == driver if driver else e["pid"] == process.pid))


def reached(process: subprocess.Popen[bytes], checkpoint: str, step: str) -> bool:
    """The driver ``process`` noted ``step`` in the timeline of ``checkpoint`` (:class:`Timeline`)."""
    return times_reached(process, checkpoint, step) > 0


def wait_step(process: subprocess.Popen[bytes], checkpoint: str, step: str, timeout_s: float, where: str) -> None:
    """Wait until the driver ``process`` notes ``step`` in the timeline of ``checkpoint``
    (:class:`Timeline`); VerifyError naming ``where`` if it exits or ``timeout_s`` passes first."""
    deadline = time.monotonic() + timeout_s
    while not reached(process, checkpoint, step):
        if process.poll() is not None or time.monotonic() > deadline:
            raise VerifyError(f"{where}: the driver did not reach {step} within {timeout_s:.0f} s (exit {process.poll()})")
        time.sleep(0.2)


@dataclass
class DriverProcess:
    """A campaign's driver process, restarted when it dies."""

    pipeline: str
    ctx: PipelineContext
    crash_dir: str
    log: Path
    env: dict[str, str]
    standby: bool = False  # a standby driver (:func:`~oncekit.core.spark.standby.stand_by`)
    prefix: tuple[str, ...] = ()  # a command the driver runs under (:func:`start_driver`)
    as_written: bool = False  # a job as written (:func:`start_driver`)
    process: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    launched: float = 0.0  # wall-clock time of the last (re)start

    def ensure_running(self, timeout_s: float = 180.0) -> None:
        """Start the driver if it is not running; the first time, wait until a query started on
        its checkpoint (a standby's: not at all)."""
        if self.process is not None and self.process.poll() is None:
            return
        first = self.process is None
        if not first:
            self.restarts += 1
            logger.info("verify: driver exited with %s; restarting it", self.process.returncode)  # type: ignore[union-attr]
        self.launched = time.time()
        self.process = start_driver(self.pipeline, self.ctx, self.crash_dir, log=self.log, env=self.env,
                                    standby=self.standby, prefix=self.prefix, as_written=self.as_written)
        if self.standby:  # the caller waits for its warm-up (wait_step("warm")) when it needs it
            return
        started = Path(self.ctx.checkpoint + ".started")
        deadline = time.monotonic() + timeout_s
        while first and not started.exists():  # any driver's query on the checkpoint (a refused one waits)
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise VerifyError(f"pipeline {self.pipeline}: the driver did not start its query "
                                  f"(exit {self.process.poll()}); its log ends: {log_tail(self.log, LOG_TAIL_LINES)}")
            time.sleep(0.2)
        spark_log = SparkLog(self.ctx.checkpoint)
        while first and spark_log.latest_planned() is None and time.monotonic() < deadline:
            # The first trigger plans an empty batch 0 at the starting offsets; a crash point armed
            # for "the next batch" must not be spent on it.
            time.sleep(0.2)

    def wait_step(self, step: str, timeout_s: float) -> None:
        """Wait until the current driver process notes ``step`` in its timeline (:func:`wait_step`).
        A driver whose Spark did not start (it exited before its session step: the JVM's gateway
        refused the connection once on a loaded machine) is started once more and waited for
        again, as a supervisor would; any other exit is a VerifyError with the end of its log."""
        for attempt in (1, 2):
            assert self.process is not None
            try:
                wait_step(self.process, self.ctx.checkpoint, step, timeout_s, f"pipeline {self.pipeline}, log {self.log}")
                return
            except VerifyError as exc:
                spark_failed = self.process.poll() is not None and not reached(self.process, self.ctx.checkpoint, "session")
                if attempt == 2 or not spark_failed:
                    raise VerifyError(f"{exc}; its log ends: {log_tail(self.log, LOG_TAIL_LINES)}") from None
                logger.warning("verify: pipeline %s: the driver's Spark did not start (exit %s); starting it once "
                               "more; its log ends: %s", self.pipeline, self.process.returncode, log_tail(self.log, LOG_TAIL_LINES))
                self.ensure_running()

    def times_reached(self, step: str) -> int:
        """How often the current driver process noted ``step`` (:func:`times_reached`)."""
        return 0 if self.process is None else times_reached(self.process, self.ctx.checkpoint, step)

    def running_query(self) -> bool:
        """The current driver process has started its query."""
        started = Path(self.ctx.checkpoint + ".started")
        return self.process is not None and self.process.poll() is None \
            and started.exists() and started.stat().st_mtime >= self.launched

    def stacks(self) -> str:
        """Where the driver and every process under it wait (:func:`~oncekit.core.stacks.process_stacks`),
        for a campaign to show why a pipeline stopped making progress. Empty without a running driver."""
        if self.process is None or self.process.poll() is not None:
            return ""
        return process_stacks(self.process.pid)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def pause(self) -> None:
        """SIGSTOP the driver and every process of its session (its JVM, its Python workers)."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGCONT)

    def stop(self, timeout_s: float = 120.0) -> int | None:
        """SIGTERM: the driver stops its query gracefully (completing its last checkpoint)."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.process.returncode
