"""Where a local session's Python processes import pyspark from (use_installed_pyspark)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pyspark
import pytest

from oncekit.core.errors import ConfigError
from oncekit.core.spark.session import use_installed_pyspark


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.MonkeyPatch:
    for name in ("SPARK_HOME", "PYSPARK_GATEWAY_PORT", "PYSPARK_PYTHON"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    return monkeypatch


def test_spark_home_links_the_installation_without_its_pyspark_zip(env: pytest.MonkeyPatch) -> None:
    use_installed_pyspark()
    home = Path(os.environ["SPARK_HOME"])
    installed = Path(pyspark.__file__).parent
    assert (home / "bin" / "spark-submit").resolve() == (installed / "bin" / "spark-submit").resolve()
    assert (home / "jars").resolve() == (installed / "jars").resolve()
    assert not (home / "python").exists()
    env.delenv("SPARK_HOME")
    use_installed_pyspark()  # a second session's process finds the folder made
    assert os.environ["SPARK_HOME"] == str(home)


@pytest.mark.parametrize("setting", [("SPARK_HOME", "/opt/spark"), ("PYSPARK_PYTHON", "/usr/bin/python3.9"),
                                     ("PYSPARK_GATEWAY_PORT", "40000")])
def test_nothing_changes_where_the_user_or_spark_submit_decided(env: pytest.MonkeyPatch,
                                                                setting: tuple[str, str]) -> None:
    env.setenv(*setting)
    use_installed_pyspark()
    assert os.environ.get("SPARK_HOME") == (setting[1] if setting[0] == "SPARK_HOME" else None)


@pytest.mark.parametrize("version", ["3.5.1", "4.1.0", "5.0.0", "unknown"])
def test_a_spark_the_kit_does_not_run_on_is_refused_by_name(version: str) -> None:
    from oncekit.core.compat import refuse_unsupported_spark

    with pytest.raises(ConfigError, match=rf"Spark {re.escape(version)}: oncekit runs on Spark 4\.2 up to \(not including\) 5\.0"):
        refuse_unsupported_spark(version)


@pytest.mark.parametrize("version", ["4.2.0", "4.2.1", "4.3.0", "4.3.1-databricks"])
def test_the_spark_versions_the_kit_runs_on_pass(version: str) -> None:
    from oncekit.core.compat import refuse_unsupported_spark

    refuse_unsupported_spark(version)
