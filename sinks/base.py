"""What every sink configuration provides to the Spark adapter and to ``oncekit.core.query``.

A sink configuration is a frozen dataclass that can travel as Spark string options (for
``df.writeStream.format(...)``) and builds the sink object in whichever process needs it: the
driver's Python worker, an executor's task, or the user's driver process (the listener).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import ClassVar

from oncekit.core.base import Sink


class SinkConfig(ABC):
    """A sink's configuration: picklable, frozen, free of open connections."""

    format_name: ClassVar[str]
    sink_id: str

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
