"""What every sink configuration provides to the Spark adapter and to ``oncekit.core.query``.

A sink configuration is a frozen dataclass that can travel as Spark string options (for
``df.writeStream.format(...)``) and builds the sink object in whichever process needs it: the
driver's Python worker, an executor's task, or the user's driver process (the listener).
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import ClassVar

from oncekit.core.base import Sink
from oncekit.core.errors import ConfigError

_SINK_ID = re.compile(r"^[A-Za-z0-9_.-]{1,100}$")


class SinkConfig(ABC):
    """A sink's configuration: picklable, frozen, free of open connections."""

    format_name: ClassVar[str]
    sink_id: str

    def _check_common(self, protocol: str, protocols: tuple[str, ...], target: str, default_id: str) -> None:
        """Called from a subclass's ``__post_init__``: the protocol is known, the target is given,
        and the sink id (which names transactions, journal folders and marker groups) is safe;
        without one it is derived from the target."""
        if protocol not in protocols:
            raise ConfigError(f"{self.format_name}: unknown protocol {protocol!r}; choose one of {', '.join(protocols)}")
        if not target:
            raise ConfigError(f"{self.format_name}: the target (table or topic) is required")
        if not self.sink_id:
            object.__setattr__(self, "sink_id", re.sub(r"[^A-Za-z0-9_.-]", "_", default_id))
        if not _SINK_ID.match(self.sink_id):
            raise ConfigError(f"{self.format_name}: sink id {self.sink_id!r} may hold only letters, digits, '_', '.', '-'")

    @abstractmethod
    def build(self, checkpoint: str) -> Sink:
        """Create the sink object for a query whose checkpoint is at ``checkpoint``."""

    @abstractmethod
    def to_options(self) -> dict[str, str]:
        """Spark string options that :meth:`from_options` turns back into this configuration."""

    @classmethod
    @abstractmethod
    def from_options(cls, options: Mapping[str, str], columns: tuple[str, ...]) -> SinkConfig:
        """Parse Spark's (lower-cased) options; ``columns`` are the stream's column names."""
