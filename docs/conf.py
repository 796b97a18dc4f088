"""Sphinx configuration of the oncekit documentation (``make docs``; strict: every warning and
every unresolved reference fails the build).

Sphinx rather than MkDocs: the kit's docstrings are reStructuredText with Sphinx roles
(``:func:``, ``:class:``, ``:mod:``), which autodoc renders and links as written; the pages are
Markdown through MyST, and the theme is Furo.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "_ext"))

import oncekit  # noqa: E402

project = "oncekit"
release = version = oncekit.__version__
copyright = "the oncekit authors"  # noqa: A001 - Sphinx's name

extensions = ["myst_parser", "sphinx.ext.autodoc", "cli_reference"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build", "examples", "bench"]
myst_heading_anchors = 3
html_theme = "furo"
html_title = f"oncekit {release}"
html_static_path = ["_static"]

autodoc_member_order = "bysource"
autodoc_typehints = "description"
nitpicky = True
# Outside the documented surface: the libraries' own types (no intersphinx: the build runs
# offline) and the kit's internals that public docstrings mention for contributors.
nitpick_ignore_regex = [
    (r"py:.*", r"(pyspark|pyarrow|psycopg|confluent_kafka|tenacity|collections|typing|pathlib|datetime)\..*"),
    (r"py:.*", r"(DataFrame|SparkSession|StreamingQuery|Path|Any|Callable|Mapping|Sequence|Iterable|Iterator)"),
    (r"py:.*", r"oncekit\.(core|sinks|sources|connectors|verify|reference|status)\..*"),
    (r"py:.*", r"(KafkaProtocol|PostgresProtocol|SinkConfig|RestartStrategy|FanOutConfig|PostgresSinkConfig|KafkaSinkConfig)"),
    (r"py:.*", r"(BaseException|Exception|float|int|str|bool|dict|list|tuple|None)"),
    # Internals the public docstrings name in their own module's short form.
    (r"py:.*", r"(BatchWatchdog|CheckpointListener|QueryRun|default_conf|fill_defaults|warm_up|REWARM_S)"),
]
