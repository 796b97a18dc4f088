"""The server-side committer: checkpoint-complete notifications where the query runs.

A query started from a Spark Connect client runs in the server's driver; a query listener would
run in the client (pyspark 4's client-side listener bus), which may die, sleep or be unable to
reach the sinks while the query goes on. So for such a query the stream writer, which runs on
the server, keeps one committer process per query run on the driver's host:

- the first writer of the run starts it (:func:`start`), so it is warm before the first commit;
- the driver-side commit of batch N wakes it with a datagram carrying N (:func:`wake`), right
  after journaling N; it waits the few milliseconds until Spark logs ``commits/N`` and commits
  every completed batch up to N (:meth:`CheckpointEngine.complete`);
- without a wake-up for :data:`SWEEP_S` it commits whatever completed (a commit that failed, its
  service down, is retried so), and it exits once idle for :data:`IDLE_EXIT_S` with nothing left,
  once a newer run of the query has started, or once the driver's JVM is gone; a wake-up that
  finds it gone starts a new one. It stays in the JVM's process group, so a signal to the
  server's group ends it too.

Its socket and lock live in a folder only the user can open; the sink's configuration (which may
hold passwords) reaches it on its stdin, never on the socket or its command line.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import time
from typing import IO

from oncekit.core.engine import CheckpointEngine, is_complete
from oncekit.core.protocol import SinkConfig

logger = logging.getLogger(__name__)

SWEEP_S = 5.0
IDLE_EXIT_S = 600.0
COMMIT_LOG_WAIT_S = 30.0  # Spark logs commits/N right after the writer's commit; a failed batch never


def _paths(checkpoint: str, sink_id: str, run: str) -> tuple[str, str]:
    """The socket and the lock file of one query run's committer on this host."""
    folder = os.path.join(tempfile.gettempdir(), f"oncekit-committers-{os.getuid()}")
    os.makedirs(folder, mode=0o700, exist_ok=True)
    key = hashlib.sha256(f"{checkpoint}\0{sink_id}\0{run}".encode()).hexdigest()[:24]
    return os.path.join(folder, f"{key}.sock"), os.path.join(folder, f"{key}.lock")


def start(config: SinkConfig, checkpoint: str, run: str, batch_id: int | None = None) -> None:
    """Stream writer on the driver: start the run's committer (a second one exits at once),
    handing it the sink's configuration on its stdin; ``batch_id`` is its first wake-up."""
    process = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE,
                               stdout=subprocess.DEVNULL, close_fds=True)
    assert process.stdin is not None
    with process.stdin:
        pickle.dump((config, checkpoint, run, batch_id, _jvm_pid()), process.stdin)
    logger.info("sink %s: started the committer of run %s (pid %s)", config.sink_id, run, process.pid)


def wake(config: SinkConfig, checkpoint: str, run: str, batch_id: int) -> None:
    """Stream writer's driver-side commit of ``batch_id``, after journaling it: tell the run's
    committer; start one if it is gone (it exited idle, or was killed). Never waits: a committer
    whose queue is full (busy in a commit, its target slow or down) has wake-ups pending, and
    commits ``batch_id`` with them or at its next sweep."""
    path, _ = _paths(checkpoint, config.sink_id, run)
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sender:
        sender.setblocking(False)
        try:
            sender.sendto(str(batch_id).encode(), path)
            return
        except BlockingIOError:
            logger.info("sink %s batch %s: the committer of run %s is busy with earlier wake-ups; it commits this "
                        "batch with them", config.sink_id, batch_id, run)
            return
        except (FileNotFoundError, ConnectionRefusedError):
            pass
    start(config, checkpoint, run, batch_id)


class Committer:
    """One run's committer; :func:`main` runs it in a process of its own."""

    def __init__(self, engine: CheckpointEngine, run: str, inbox: socket.socket, jvm: int | None = None) -> None:
        self.engine, self.run, self.inbox, self.jvm = engine, run, inbox, jvm
        self.sink_id = engine.sink.sink_id

    def serve(self, first: int | None) -> None:
        """Commit at every wake-up, sweep between them, acting for the run's epoch; return when
        idle, superseded (the journal's newest run is another, of a higher epoch) or orphaned."""
        batch_id, last_wake = first, time.monotonic()
        while self.engine.journal.run() == self.run:
            if self.jvm is not None and not _alive(self.jvm):
                logger.info("sink %s: the driver JVM (pid %s) is gone; the committer of run %s exits", self.sink_id,
                            self.jvm, self.run)
                return
            self._commit(batch_id)
            try:
                batch_id, last_wake = self._newest(int(self.inbox.recv(32))), time.monotonic()
            except TimeoutError:
                batch_id = None
                if time.monotonic() - last_wake > IDLE_EXIT_S and not self.engine.uncommitted():
                    logger.info("sink %s: committer of run %s idle for %.0f s; exits", self.sink_id, self.run,
                                IDLE_EXIT_S)
                    return
        logger.info("sink %s: a newer run of the query started; the committer of run %s exits", self.sink_id, self.run)

    def _newest(self, batch_id: int) -> int:
        """``batch_id`` or the newest of the wake-ups queued behind it: one commit serves them all
        (it commits every completed batch up to the id). Read without waiting: a socket with a
        timeout waits for a datagram before any read, whatever its flags."""
        timeout = self.inbox.gettimeout()
        self.inbox.setblocking(False)
        try:
            while True:
                try:
                    batch_id = max(batch_id, int(self.inbox.recv(32)))
                except (BlockingIOError, InterruptedError):
                    return batch_id
        finally:
            self.inbox.settimeout(timeout)

    def drain(self) -> None:
        """After the socket is unlinked (no new wake-up reaches it): commit what the last
        wake-ups asked for."""
        self.inbox.setblocking(False)
        while True:
            try:
                batch_id = int(self.inbox.recv(32))
            except (BlockingIOError, OSError):
                return
            self._commit(batch_id)

    def _commit(self, batch_id: int | None) -> None:
        """Commit every completed batch up to ``batch_id`` once Spark logged it (all that
        completed, for None). Failures are logged: the next sweep retries them."""
        try:
            if batch_id is not None:
                self._await_commit_log(batch_id)
            committed = self.engine.complete(batch_id)
            if committed:
                logger.info("sink %s: checkpoints %s complete and committed (run %s)", self.sink_id, committed, self.run)
        except Exception as exc:  # noqa: BLE001 - a sink service down: the sweep retries
            logger.error("sink %s batch %s: checkpoint-complete commit failed, retried in %.0f s: %s",
                         self.sink_id, batch_id, SWEEP_S, exc)

    def _await_commit_log(self, batch_id: int) -> None:
        # Spark writes commits/N right after the writer's commit returns: milliseconds. A batch
        # that failed after its journal never gets it; its batch is the next run's recovery's.
        deadline, pause = time.monotonic() + COMMIT_LOG_WAIT_S, 0.002
        while not is_complete(batch_id, self.engine.spark_log.completed()):
            if time.monotonic() > deadline:
                logger.warning("sink %s batch %s: Spark did not log the batch complete within %.0f s; "
                               "committing what completed", self.sink_id, batch_id, COMMIT_LOG_WAIT_S)
                return
            time.sleep(pause)
            pause = min(pause * 2, 0.02)


def _jvm_pid() -> int | None:
    """The driver JVM above this Python worker (Spark starts workers from the JVM, or from a
    daemon the JVM started); None where /proc cannot tell."""
    pid = os.getppid()
    for _ in range(4):
        try:
            with open(f"/proc/{pid}/comm") as comm:
                if comm.read().strip() == "java":
                    return pid
            with open(f"/proc/{pid}/stat") as stat:
                pid = int(stat.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return None
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def main(stdin: IO[bytes]) -> None:
    config, checkpoint, run, first, jvm = pickle.load(stdin)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s oncekit committer: %(message)s")
    path, lock_path = _paths(checkpoint, config.sink_id, run)
    with open(lock_path, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return  # the run's committer is alive; a wake-up raced its start
        try:
            os.unlink(path)  # a killed committer's
        except FileNotFoundError:
            pass
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as inbox:
            inbox.bind(path)
            inbox.settimeout(SWEEP_S)
            engine = CheckpointEngine.for_run(config, checkpoint, run)
            if engine is None:
                return  # the run took no epoch: it decided nothing to commit
            committer = Committer(engine, run, inbox, jvm)
            try:
                committer.serve(first)
            finally:
                os.unlink(path)
                committer.drain()


if __name__ == "__main__":
    main(sys.stdin.buffer)
