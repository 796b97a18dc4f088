"""The ``oncekit-cli`` directive: the help of every ``oncekit`` command and subcommand, from the
command line's own parser (:func:`oncekit.cli.parser`), so the CLI reference cannot drift from
the CLI."""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from typing import Any

from docutils import nodes
from sphinx.util.docutils import SphinxDirective


def commands(parser: argparse.ArgumentParser, path: list[str]) -> Iterator[tuple[list[str], argparse.ArgumentParser]]:
    """Every (command words, parser) under ``parser``, depth first."""
    yield path, parser
    for action in parser._actions:  # argparse keeps subcommands only there
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from commands(sub, [*path, name])


class CliReference(SphinxDirective):
    def run(self) -> list[nodes.Node]:
        from oncekit.cli import parser

        os.environ["COLUMNS"] = "100"  # argparse wraps at the terminal's width
        out: list[nodes.Node] = []
        for path, each in commands(parser(), ["oncekit"]):
            name = " ".join(path)
            out.append(nodes.rubric(text=name, ids=[nodes.make_id(name)]))
            out.append(nodes.literal_block(text=each.format_help().strip(), language="text"))
        return out


def setup(app: Any) -> dict[str, Any]:
    app.add_directive("oncekit-cli", CliReference)
    return {"parallel_read_safe": True}
