"""A Spark Connect server on loopback, started from the pyspark distribution (its
``SparkConnectServer`` class, what ``sbin/start-connect-server.sh`` runs), for tests and
``oncekit verify`` runs of pipelines whose driver program is a Connect client.

The server is the query's driver: its Python workers import oncekit from the server's Python
(``PYSPARK_PYTHON``, this interpreter unless set), and crash points reach them through its
environment. Called by the verification suite; a user passes their own server's
``sc://host:port`` in ``SPARK_REMOTE`` instead.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from oncekit.connectors.services.base import free_port
from oncekit.connectors.services.spark_cluster import spark_home
from oncekit.core.errors import ServiceError

logger = logging.getLogger(__name__)

SERVER_CLASS = "org.apache.spark.sql.connect.service.SparkConnectServer"
_STARTED = "Spark Connect server started"


class ConnectServer:
    """``start()`` returns the ``sc://`` URL once the server listens; ``kill()`` ends it with
    SIGKILL (its JVM and every Python worker under it), ``stop()`` with SIGTERM. A restarted
    server listens on the same port. Its log goes to ``work_dir/connect-<n>.log``."""

    def __init__(self, work_dir: Path, master: str = "local[2,4]", env: Mapping[str, str] | None = None,
                 conf: Mapping[str, str] | None = None) -> None:
        self.work_dir, self.master = work_dir, master
        self.env, self.conf = dict(env or {}), dict(conf or {})
        self.port = free_port()
        self.url = f"sc://127.0.0.1:{self.port}"
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def __repr__(self) -> str:
        return f"ConnectServer(url={self.url!r}, master={self.master!r})"

    def start(self, timeout_s: float = 180.0) -> str:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.starts += 1
        log = self.log
        python = self.env.get("PYSPARK_PYTHON") or os.environ.get("PYSPARK_PYTHON") or sys.executable
        conf = {"spark.connect.grpc.binding.port": str(self.port), "spark.connect.grpc.binding.address": "127.0.0.1",
                "spark.pyspark.python": python, "spark.ui.enabled": "false", **self.conf}
        command = [str(spark_home() / "bin" / "spark-submit"), "--class", SERVER_CLASS, "--name", "oncekit-connect",
                   "--master", self.master]
        for key, value in conf.items():
            command += ["--conf", f"{key}={value}"]
        env = {**os.environ, **self.env, "SPARK_HOME": str(spark_home()), "SPARK_LOCAL_IP": "127.0.0.1",
               "PYSPARK_PYTHON": python}
        env.pop("SPARK_REMOTE", None)
        with log.open("ab") as out:
            self.process = subprocess.Popen([*command, "spark-internal"], env=env, stdout=out,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while _STARTED not in log.read_text(errors="replace"):
            if self.process.poll() is not None or time.monotonic() > deadline:
                exited = self.process.poll()
                self.kill()
                raise ServiceError(f"spark connect server did not start ({'exit ' + str(exited) if exited is not None else 'timeout'}); "
                                   f"see {log}")
            time.sleep(0.2)
        logger.info("spark connect server up at %s (%s)", self.url, self.master)
        return self.url

    @property
    def log(self) -> Path:
        """The current start's log."""
        return self.work_dir / f"connect-{self.starts}.log"

    def kill(self) -> None:
        """SIGKILL to the server's session: the JVM and its Python workers die at once."""
        self._signal(signal.SIGKILL)

    def stop(self) -> None:
        self._signal(signal.SIGTERM)

    def _signal(self, signum: int) -> None:
        if self.process is None:
            return
        try:
            os.killpg(self.process.pid, signum)
        except ProcessLookupError:
            pass
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)
        self.process = None
