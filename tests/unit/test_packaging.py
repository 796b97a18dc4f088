"""The wheel holds the oncekit packages and py.typed, and nothing else of the repository; a plain
install pulls only the library's clients, the rest is in extras."""

from __future__ import annotations

import email
import subprocess
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import oncekit

ROOT = Path(__file__).resolve().parents[2]


def test_wheel_holds_only_oncekit_packages(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names}
    assert top == {"oncekit", wheel.name.split("-py")[0] + ".dist-info"}
    packages = {name.rsplit("/", 1)[0] for name in names if name.endswith(".py")}
    assert packages == {"oncekit", "oncekit/core", "oncekit/core/spark", "oncekit/sources", "oncekit/sinks",
                        "oncekit/sinks/postgres", "oncekit/sinks/kafka", "oncekit/connectors",
                        "oncekit/connectors/services", "oncekit/verify", "oncekit/reference", "oncekit/status"}
    assert "oncekit/py.typed" in names
    assert "oncekit/reference/pipeline.toml" in names  # the pipeline's default config, read at run time
    # the status page's assets, served from the package (no CDN): page, script, style, uPlot and its licence
    assert {"oncekit/status/static/index.html", "oncekit/status/static/status.js", "oncekit/status/static/status.css",
            "oncekit/status/static/uplot/uPlot.iife.min.js", "oncekit/status/static/uplot/uPlot.min.css",
            "oncekit/status/static/uplot/LICENSE"} <= set(names)
    # the alert rules and the dashboard the docs point at
    assert {"oncekit/status/monitoring/alerts.yml", "oncekit/status/monitoring/dashboard.json"} <= set(names)
    assert not [n for n in names if "tests" in n or "docker" in n.split("/")[1:2] or n.endswith((".sh", ".xml"))
                or (n.endswith(".yml") and not n.startswith("oncekit/status/monitoring/"))]


def test_wheel_metadata_keeps_spark_and_tools_in_extras(wheel: Path) -> None:
    archive = zipfile.ZipFile(wheel)
    dist_info = wheel.name.split("-py")[0] + ".dist-info"
    metadata = email.message_from_bytes(archive.read(f"{dist_info}/METADATA"))
    requirements = [Requirement(line) for line in metadata.get_all("Requires-Dist", [])]
    # A user's job environment gets these only by asking: pyspark is the cluster's, the rest serve
    # the status page, the services backends, Spark Connect and the tests.
    core = {canonicalize_name(r.name) for r in requirements if r.marker is None or "extra" not in str(r.marker)}
    assert not core & {"pyspark", "testcontainers", "docker", "starlette", "uvicorn", "prometheus-client", "grpcio",
                       "pandas", "pytest", "playwright", "sphinx"}
    assert {"spark", "connect", "status", "services", "docs", "dev"} <= set(metadata.get_all("Provides-Extra", []))
    # make install's dev extra installs every other extra but bench (which has a venv of its own)
    (everything,) = [r for r in requirements if canonicalize_name(r.name) == "oncekit"]
    assert everything.extras == {"spark", "connect", "status", "services", "docs"}
    assert str(everything.marker) == 'extra == "dev"'
    assert metadata["Version"] == oncekit.__version__
    assert wheel.name.startswith(f"oncekit-{oncekit.__version__}-")
    assert archive.read(f"{dist_info}/licenses/LICENSE") == (ROOT / "LICENSE").read_bytes()
    assert metadata["License-Expression"] == "Apache-2.0"


def test_no_wheel_is_committed_at_the_root() -> None:
    committed = subprocess.run(["git", "ls-files", "--", ":(glob)*.whl"], cwd=ROOT, capture_output=True, text=True,
                               check=True).stdout.split()
    assert committed == []
