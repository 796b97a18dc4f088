"""5. The reference pipeline (reference/): a hook for its measurement.

To be filled: run the reference pipeline on ``services`` over ``options.records`` records and
return its table (read its outputs back before a figure counts, as every group does).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from benchmarks.table import Row, Table

if TYPE_CHECKING:
    from benchmarks.environment import Options
    from oncekit.connectors import Services


def reference_pipeline(services: Services, options: Options) -> Table:
    table = Table("5. Reference pipeline (reference/)", ("seconds", "records/s"), ("records/s",), "")
    table.rows.append(Row("reference pipeline", {}, "not yet measured"))
    return table
