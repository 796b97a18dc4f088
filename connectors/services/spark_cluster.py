"""A Spark standalone cluster on loopback: one master and one worker started from the pyspark
distribution's ``bin/spark-class``, for tests and ``oncekit verify`` runs that must not rely on
local mode (executors are separate JVMs with their own Python workers).

Called by the verification suite; a user with a real cluster passes its master URL instead.
"""

from __future__ import annotations

import logging
import os
import subprocess
import time
from pathlib import Path

from oncekit.connectors.services.base import free_port
from oncekit.core.errors import ServiceError

logger = logging.getLogger(__name__)


def spark_home() -> Path:
    """The Spark distribution pyspark ships (``SPARK_HOME`` if set)."""
    if os.environ.get("SPARK_HOME"):
        return Path(os.environ["SPARK_HOME"])
    import pyspark

    return Path(pyspark.__file__).parent


class StandaloneCluster:
    """``start()`` returns the master URL once a worker has registered; ``stop()`` ends both.
    Its worker offers ``cores`` cores and ``memory`` to executors; logs go to ``work_dir``."""

    def __init__(self, work_dir: Path, cores: int = 2, memory: str = "2g") -> None:
        self.work_dir, self.cores, self.memory = work_dir, cores, memory
        self.port = free_port()
        self.url = f"spark://127.0.0.1:{self.port}"
        self.processes: list[subprocess.Popen[bytes]] = []

    def __repr__(self) -> str:
        return f"StandaloneCluster(url={self.url!r}, cores={self.cores})"

    def _launch(self, name: str, main_class: str, *args: str) -> Path:
        log = self.work_dir / f"{name}.log"
        env = {**os.environ, "SPARK_HOME": str(spark_home()), "SPARK_LOCAL_IP": "127.0.0.1",
               "SPARK_NO_DAEMONIZE": "1"}
        with log.open("ab") as out:
            self.processes.append(subprocess.Popen(
                [str(spark_home() / "bin" / "spark-class"), main_class, *args],
                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
        return log

    def start(self, timeout_s: float = 120.0) -> str:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        master_log = self._launch("master", "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                                  "--port", str(self.port), "--webui-port", str(free_port()))
        self._launch("worker", "org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1",
                     "--cores", str(self.cores), "--memory", self.memory, "--webui-port", str(free_port()),
                     "--work-dir", str(self.work_dir / "work"), self.url)
        deadline = time.monotonic() + timeout_s
        while "Registering worker" not in master_log.read_text(errors="replace"):
            dead = [name for name, p in zip(("master", "worker"), self.processes) if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                self.stop()
                raise ServiceError(f"spark standalone cluster did not start ({', '.join(dead) or 'timeout'}); "
                                   f"see {self.work_dir}")
            time.sleep(0.5)
        logger.info("spark standalone cluster up at %s (%s cores)", self.url, self.cores)
        return self.url

    def executor_pids(self) -> list[int]:
        """The executor JVMs the worker runs now, for faults that kill one: the processes of the
        worker's session (it launches executors as plain children) running Spark's executor."""
        if len(self.processes) < 2 or self.processes[1].poll() is not None:
            return []
        worker = self.processes[1].pid
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if os.getsid(int(entry.name)) == worker and \
                        b"CoarseGrainedExecutorBackend" in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:  # gone meanwhile
                continue
        return sorted(pids)

    def stop(self) -> None:
        for process in reversed(self.processes):
            if process.poll() is None:
                os.killpg(process.pid, 15)
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, 9)
        self.processes.clear()
