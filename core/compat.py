"""The Spark versions the kit runs on, and the named refusal a job on any other gets."""

from __future__ import annotations

from oncekit.core.errors import ConfigError

SUPPORTED_SPARK = ((4, 2), (5, 0))
"""The Spark versions the kit supports, from the first up to (not including) the second: the
``[spark]`` extra's ``pyspark>=4.2,<5`` in pyproject.toml."""


def spark_supported(version: str) -> bool:
    """Whether Spark ``version`` (``4.3.0``, ``4.2.1-databricks``...) is one the kit runs on."""
    try:
        major, minor = (int(part) for part in version.split(".")[:2])
    except ValueError:
        return False
    return SUPPORTED_SPARK[0] <= (major, minor) < SUPPORTED_SPARK[1]


def refuse_unsupported_spark(version: str) -> None:
    """Called by :func:`~oncekit.core.spark.query.start_query` with the session's Spark version
    (a Spark Connect server's, for its client): ConfigError naming the version and the supported
    ones, before anything is started."""
    if not spark_supported(version):
        (low_major, low_minor), (high_major, _) = SUPPORTED_SPARK
        raise ConfigError(f"Spark {version}: oncekit runs on Spark {low_major}.{low_minor} up to (not including) "
                          f"{high_major}.0, whose Python data sources have the streaming writers, admission control "
                          "and Arrow batches its source and sinks are built on; run the job on a supported Spark "
                          "(pip install 'oncekit[spark]' brings one)")
