"""Stalls of a query, kept beside its checkpoint so that any process can count them.

``<checkpoint>/oncekit/stalls.json``: ``{"total": N, "recent": [...]}``, the newest
:data:`RECENT` stalls first, each ``{"batch", "at" (seconds since the epoch), "waited_s",
"message"}``. Written by the batch watchdog of the query's driver (one driver per checkpoint),
read by the status page (``oncekit_stalled_batches_total``).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

from oncekit.core.storage import filesystem, read_bytes, write_atomically

RECENT = 20


@dataclass(frozen=True)
class Stall:
    batch: int
    at: float
    waited_s: float
    message: str


class StallLog:
    """The stalls of the query checkpointed at ``checkpoint``."""

    def __init__(self, checkpoint: str) -> None:
        self.fs, root = filesystem(checkpoint)
        self.path = f"{root}/oncekit/stalls.json"

    def read(self) -> tuple[int, list[Stall]]:
        """(how many stalls ever, the recent ones newest first); (0, []) when none was recorded."""
        try:
            data = json.loads(read_bytes(self.fs, self.path))
        except FileNotFoundError:
            return 0, []
        return int(data["total"]), [Stall(**s) for s in data["recent"]]

    def record(self, batch: int, waited_s: float, message: str) -> int:
        """Driver, the batch watchdog: one more stall; returns the new total."""
        total, recent = self.read()
        recent = [Stall(batch, time.time(), round(waited_s, 1), message), *recent][:RECENT]
        write_atomically(self.fs, self.path, json.dumps({"total": total + 1, "recent": [asdict(s) for s in recent]}).encode())
        return total + 1
