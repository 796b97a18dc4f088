"""The Spark session with oncekit's defaults.

Called by the user's driver program, the demo and the tests. It fills oncekit's defaults only
where the job (``spark-submit --conf``, the builder) and the cluster (``spark-defaults.conf``)
left a setting unset, and logs what it set. It sets nothing that only works in local mode: the
master comes from ``spark-submit`` or ``SPARK_MASTER`` when given, and only a local master's
executors get the driver's interpreter as their Python (unless ``PYSPARK_PYTHON`` says). With
``SPARK_REMOTE`` (pyspark's own setting, ``sc://host:port``) the session is a Spark Connect
client's: the server has its own master, cluster settings and Python.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

from pyspark.sql import SparkSession

logger = logging.getLogger(__name__)

CONNECT_MAX_BACKOFF_MS = 2_000
"""The Spark Connect client's longest pause between two attempts to reach its server. pyspark's
own backs off to 60 s (50 ms times 4 each time): a client whose server restarted 30 s after it
went away waited 41 s more before its next attempt (tests/eos/test_connect.py); 300 attempts
keep pyspark's ten minutes in all."""

ROCKSDB_PROVIDER = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"
CHANGELOG_CHECKPOINTING = "spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled"


def is_connect(spark: SparkSession) -> bool:
    """Whether ``spark`` is a Spark Connect client's session (its queries run on the server)."""
    return type(spark).__module__.startswith("pyspark.sql.connect")


def register_data_source(spark: SparkSession, source: type) -> None:
    """Register the Python data source ``source`` with ``spark``, and make ``spark`` the calling
    thread's active session. Spark looks a Python data source's name up in the active session
    of the thread that loads or starts the stream, and only the thread that created the session
    has one: without this, a query started from another thread (a job that supervises its
    queries from one, the demo starting Spark beside its services) fails at start with
    DATA_SOURCE_NOT_FOUND. Called by the kit's source, sinks and warm-up before they build a
    stream; a Spark Connect server keeps its own sessions."""
    spark.dataSource.register(source)
    if not is_connect(spark):
        jvm, session = getattr(spark, "_jvm"), getattr(spark, "_jsparkSession")
        jvm.org.apache.spark.sql.SparkSession.setActiveSession(session)


def default_parallelism(spark: SparkSession) -> int | None:
    """The session's default parallelism; None where the session cannot tell (a Spark Connect
    client has no SparkContext)."""
    try:
        return int(spark.sparkContext.defaultParallelism)
    except Exception:  # noqa: BLE001 - Spark Connect: PySparkNotImplementedError, or no attribute
        return None


def default_conf(cores: int | None = None) -> dict[str, str]:
    """Spark session settings oncekit's pipelines expect, where nobody chose otherwise.

    RocksDB keeps streaming state off the JVM heap and is what transformWithState needs; with
    changelog checkpointing a batch's state commit uploads only the changes of the batch, and
    snapshots are taken in the background (Spark's default, off, uploads a snapshot per batch;
    ``make bench`` group ``state`` measures both). Shuffle partitions follow the cores (Spark's
    200 default makes every micro-batch of a small job run 200 tasks). They become a stateful
    query's state partitions for good (only a savepoint restore with ``state_partitions`` changes
    them), so a job on a cluster should choose them itself, with ``--conf
    spark.sql.shuffle.partitions=N`` for the parallelism it will grow to.
    """
    cores = cores or os.cpu_count() or 2
    return {
        "spark.sql.streaming.stateStore.providerClass": ROCKSDB_PROVIDER,
        CHANGELOG_CHECKPOINTING: "true",
        "spark.sql.shuffle.partitions": str(max(2, cores)),
        "spark.sql.execution.arrow.pyspark.enabled": "true",
        "spark.sql.streaming.stopGracefullyOnShutdown": "true",
    }


def spark_session(app_name: str = "oncekit", master: str | None = None, conf: Mapping[str, str] | None = None) -> SparkSession:
    """Get or create the session with ``conf``, then :func:`default_conf` for the settings still
    unset (:func:`fill_defaults`), and the log level WARN where nobody chose logging
    (``quiet_default_logging``).

    With ``SPARK_REMOTE`` set, a Spark Connect session to that server instead, with the session
    settings of both (``spark.sql.*``, ``spark.oncekit.*``; the others are the server's, fixed
    when it started).

    :param app_name: Spark's application name, unless spark-submit gave one.
    :param master: the master URL; default ``SPARK_MASTER``, then what spark-submit was given
        (``local[*]`` if nothing).
    :param conf: Spark settings for the session; they win over every default the kit fills in.
    """
    remote = os.environ.get("SPARK_REMOTE")
    if remote:
        from pyspark.sql.connect.client.retries import DefaultPolicy  # the Connect client's modules: only for it

        connect = SparkSession.builder.remote(remote)
        for key, value in (conf or {}).items():
            if key.startswith(("spark.sql.", "spark.oncekit.")):
                connect = connect.config(key, value)
        session = connect.getOrCreate()
        session.client.set_retry_policies([DefaultPolicy(max_backoff=CONNECT_MAX_BACKOFF_MS, max_retries=300)])
        fill_defaults(session)
        return session
    builder = SparkSession.builder.appName(app_name)
    master = master or os.environ.get("SPARK_MASTER")
    submitted = "PYSPARK_GATEWAY_PORT" in os.environ  # spark-submit started the JVM, with its own settings
    if not submitted and (master is None or master.startswith("local")):
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        use_installed_pyspark()
    if master:  # else spark-submit's own, which is local[*] when nothing set one
        builder = builder.master(master)
    for key, value in (conf or {}).items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    quiet_default_logging(session)
    fill_defaults(session)
    return session


SPARK_DEFAULT_LOG4J = "org/apache/spark/log4j2-defaults.properties"


def quiet_default_logging(session: SparkSession) -> bool:
    """Called by :func:`spark_session` for a session it started or got: set Spark's log level to
    WARN only where nobody chose logging (Spark's own default log4j profile is in use, which logs
    every task at INFO, and ``spark.log.level`` is unset); log that it did. Whether it set it."""
    conf = session.sparkContext.getConf()
    if conf.contains("spark.log.level"):
        return False
    try:
        jvm = getattr(session, "_jvm")
        source = jvm.org.apache.logging.log4j.LogManager.getContext(False).getConfiguration().getConfigurationSource()
        location = str(source.getLocation() or "")
    except Exception as exc:  # noqa: BLE001 - another logging backend: it is the job's to set
        logger.debug("spark session: log4j's configuration unknown (%s); the log level is left as it is", exc)
        return False
    if not location.endswith(SPARK_DEFAULT_LOG4J):
        return False
    session.sparkContext.setLogLevel("WARN")
    logger.info("spark session: oncekit set the log level to WARN (Spark's default log4j profile was in use; "
                "spark.log.level or a log4j2.properties of the job or cluster choose another)")
    return True


def fill_defaults(session: SparkSession) -> dict[str, str]:
    """Set :func:`default_conf`'s settings that the session does not have yet (neither the job,
    ``spark-submit --conf``, ``spark-defaults.conf`` nor a managed runtime set them); returns
    and logs what it set."""
    chosen = session.conf.getAll
    filled = {key: value for key, value in default_conf().items() if key not in chosen}
    for key, value in filled.items():
        session.conf.set(key, value)
    if filled:
        logger.info("spark session: oncekit set %s (unset by the job and the cluster)",
                    ", ".join(f"{k}={v}" for k, v in filled.items()))
    return filled


def use_installed_pyspark() -> None:
    """Called by :func:`spark_session` before it starts a local JVM: have Spark's Python
    processes import pyspark from this interpreter's installation rather than ``pyspark.zip``.

    Spark puts ``$SPARK_HOME/python/lib/pyspark.zip`` first on the path of every Python process
    it starts (each data source planner, stream runner and task worker daemon), and Python
    compiles what it imports from a zip afresh every time: 1.3 s against 0.4 s from the
    installation's cached bytecode, on two cores, for each of the seven or more processes a
    query's start and first batch need. So ``SPARK_HOME`` becomes a folder of links to the pip
    installation's ``bin``, ``jars`` and the rest, without its ``python`` folder: the JVM is the
    same, and the processes import the same pyspark files, compiled once. Only when nothing else
    decides: ``SPARK_HOME`` unset, no JVM started yet (``spark-submit`` starts its own), and the
    workers' Python this interpreter (``PYSPARK_PYTHON``).
    """
    if "SPARK_HOME" in os.environ or "PYSPARK_GATEWAY_PORT" in os.environ:
        return
    if os.path.realpath(os.environ.get("PYSPARK_PYTHON", sys.executable)) != os.path.realpath(sys.executable):
        return
    import pyspark

    home = Path(pyspark.__file__).parent
    if not (home / "python" / "lib" / "pyspark.zip").exists() or not (home / "bin" / "spark-submit").exists():
        return
    key = hashlib.sha256(f"{home} {pyspark.__version__}".encode()).hexdigest()[:16]
    mirror = Path(tempfile.gettempdir()) / f"oncekit-spark-home-{os.getuid()}" / key
    if not mirror.exists():
        mirror.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=mirror.parent))
        for entry in home.iterdir():
            if entry.name != "python":
                (staging / entry.name).symlink_to(entry)
        try:
            staging.rename(mirror)
        except OSError:  # another process made it first
            shutil.rmtree(staging)
    os.environ["SPARK_HOME"] = str(mirror)
