"""The wheel holds the oncekit packages and py.typed, and nothing else of the repository."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_wheel_holds_only_oncekit_packages(tmp_path: Path) -> None:
    # Build from a copy: setuptools leaves build/ and *.egg-info beside the sources.
    source = tmp_path / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".venv", ".oncekit", ".git", "target", "__pycache__"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(source)],
        check=True,
    )
    (wheel,) = tmp_path.glob("oncekit-*.whl")
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
    assert not [n for n in names if "tests" in n or "docker" in n.split("/")[1:2] or n.endswith((".yml", ".sh", ".xml"))]
