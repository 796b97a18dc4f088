"""The console blocks of the documentation site, for the tests that run them.

A page writes each console block as a named ``code-block`` (``:name: quickstart-run``); a test
that runs it reads its commands here by that name, so a page and the command a test runs cannot
drift apart. ``test_site`` checks that every named block is read by some test and that no page
has an unnamed console block.
"""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs"
NAMED = re.compile(r"^```\{code-block\} console\n:name: ([\w-]+)\n\n(.*?)^```", re.S | re.M)


def console_blocks() -> dict[str, tuple[str, str]]:
    """Every named console block of the site: its name, the page it is on and its text."""
    found: dict[str, tuple[str, str]] = {}
    for page in sorted(DOCS.glob("*.md")):
        for block in NAMED.finditer(page.read_text()):
            assert block.group(1) not in found, f"{page.name}: a second console block named {block.group(1)!r}"
            found[block.group(1)] = (page.name, block.group(2))
    return found


def console_commands(name: str, replace: dict[str, str] | None = None) -> list[str]:
    """The commands of the console block ``name``, for ``bash -c``: the ``$`` prompt dropped,
    continuation lines joined, comment-only lines left out; each key of ``replace`` (in order)
    replaced by its value, a host or path of the page by the test's own. A key the block does
    not contain fails, so a page that changes fails the test that runs it."""
    page, text = console_blocks()[name]
    for old, new in (replace or {}).items():
        assert old in text, f"{page}: console block {name!r} no longer contains {old!r}"
        text = text.replace(old, new)
    commands: list[str] = []
    for line in text.splitlines():
        if line.startswith("$ "):
            commands.append(line[2:])
        elif commands and commands[-1].endswith("\\"):
            commands[-1] = commands[-1][:-1].rstrip() + " " + line.strip()
        else:
            raise AssertionError(f"{page}: console block {name!r} has output or a stray line: {line!r}")
    return [command for command in commands if not command.lstrip().startswith("#")]
