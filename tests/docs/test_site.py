"""The documentation site: it builds strictly (every warning and unresolved reference fails),
headless chromium finds every page of its navigation and every image, and every command of its
console blocks is one the ``oncekit`` command line accepts.

Every console block is a named one that a test reads and runs (tests/docs/console.py); every
``oncekit`` command written inline is one the command line accepts. The Python examples the
pages include run in test_examples.py and test_walkthrough.py; a Python block written in a page
itself (none today) is compiled here.
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urldefrag, urlparse

import pytest

from oncekit import cli
from tests.docs.console import console_blocks, console_commands

DOCS = Path(__file__).resolve().parents[2] / "docs"
TESTS = Path(__file__).resolve().parents[1]
INLINE_COMMAND = re.compile(r"`(oncekit [^`]+)`")
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking"]
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```", re.S | re.M)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    built = subprocess.run([sys.executable, "-m", "sphinx", "-b", "html", "-W", "--keep-going", "-n", "-q",
                            str(DOCS), str(out)], capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stdout + built.stderr
    return out


def blocks(language: str) -> Iterator[tuple[str, str]]:
    for page in sorted(DOCS.glob("*.md")):
        for found in BLOCK.finditer(page.read_text()):
            if found.group(1) == language:
                yield page.name, found.group(2)


def test_site_builds_strictly_and_chromium_finds_every_page_and_image(site: Path) -> None:
    from playwright.sync_api import sync_playwright

    start = (site / "index.html").as_uri()
    missing: list[str] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        page = browser.new_page()
        page.goto(start)
        navigation = page.eval_on_selector_all(".sidebar-tree a.reference", "links => links.map(a => a.href)")
        pages = sorted({urldefrag(link)[0] for link in navigation})
        assert len(pages) >= 12, pages
        for url in pages:
            if not Path(urlparse(url).path).exists():
                missing.append(f"navigation: {url}")
                continue
            page.goto(url)
            assert page.title(), url
            broken = page.eval_on_selector_all("img", "images => images.filter(i => !i.complete || i.naturalWidth === 0)"
                                                      ".map(i => i.src)")
            missing += [f"{url}: image {src}" for src in broken]
            raw = page.eval_on_selector_all("p", "ps => ps.map(p => p.textContent.trim()).filter(t => t.startsWith('|'))")
            missing += [f"{url}: a table row rendered as text: {text[:80]}" for text in raw]
            links = page.eval_on_selector_all("a[href]", "links => links.map(a => a.href)")
            missing += [f"{url}: link {link}" for link in links if link.startswith("file://")
                        and not Path(urlparse(urldefrag(link)[0]).path).exists()]
        browser.close()
    assert missing == []


API_ENTRIES = {
    "oncekit.kafka_stream": ["spark", "bootstrap_servers", "topics", "max_offsets_per_trigger", "starting_offsets",
                             "connector", "options"],
    "oncekit.postgres_sink": ["dsn", "table", "protocol", "sink_id", "key_columns", "on_conflict", "dead_letter_table"],
    "oncekit.kafka_sink": ["bootstrap_servers", "topic", "protocol", "sink_id", "client", "partitions",
                           "transaction_timeout_ms", "dead_letter_topic"],
    "oncekit.fan_out": ["targets", "route_column", "sink_id"],
    "oncekit.start_query": ["frame", "sink", "checkpoint", "trigger", "query_name", "output_mode", "notify",
                            "batch_timeout"],
    "oncekit.OncekitQuery.await_termination": ["timeout"],
    "oncekit.OncekitQuery.stop": [],
    "oncekit.OncekitQuery.stop_at_batch_boundary": ["timeout_s"],
    "oncekit.spark_session": ["app_name", "master", "conf"],
    "oncekit.supervise": ["run", "strategy", "on_restart"],
}
"""The API page's entry points, each with the parameters whose meaning it must say."""


def test_the_api_page_shows_every_entry_point_and_what_each_parameter_means(site: Path) -> None:
    """In chromium, the rendered API page: each entry of :data:`API_ENTRIES` is there, with a
    description, and each of its parameters is listed with its meaning (``name (type) – what it
    is``), not its type alone. OncekitQuery shows no constructor (the kit builds it)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        page = browser.new_page()
        page.goto((site / "api.html").as_uri())
        entries = page.eval_on_selector_all("dl.py > dt[id]", """dts => Object.fromEntries(dts.map(dt => [dt.id, {
            signature: dt.textContent,
            described: dt.nextElementSibling.querySelector(':scope > p') !== null,
            params: [...dt.nextElementSibling.querySelectorAll(':scope > dl.field-list > dt')]
                .filter(field => field.textContent.trim().startsWith('Parameters'))
                .flatMap(field => [...field.nextElementSibling.querySelectorAll('li, dd > p')])
                .map(item => item.textContent.trim())}]))""")
        browser.close()
    problems = []
    for entry, parameters in API_ENTRIES.items():
        found = entries.get(entry)
        if found is None:
            problems.append(f"{entry}: not on the page")
            continue
        if not found["described"]:
            problems.append(f"{entry}: no description")
        for name in parameters:
            lines = [line for line in found["params"] if line.split(" ", 1)[0].lstrip("*") == name]
            if not lines or not re.search(r"[–—-] \S", lines[0]):
                problems.append(f"{entry}: parameter {name} has no meaning ({lines[:1]})")
    constructor = entries.get("oncekit.OncekitQuery", {}).get("signature", "")
    if "query" in constructor.split("OncekitQuery", 1)[-1]:
        problems.append(f"OncekitQuery shows its internal constructor: {constructor}")
    assert problems == []


def test_every_console_block_is_named_and_run_by_a_test() -> None:
    unnamed = [page for page, _ in blocks("console")]
    assert unnamed == [], f"console blocks without a name (a test cannot run them): {unnamed}"
    named = console_blocks()
    assert len(named) >= 8, named
    tests = "\n".join(path.read_text() for path in TESTS.rglob("test_*.py"))
    unread = [f"{page}: {name}" for name, (page, _) in named.items()
              if not re.search(rf'console_commands\(\s*"{name}"', tests)]
    assert unread == [], f"console blocks no test runs: {unread}"


def test_every_oncekit_command_on_the_site_is_accepted_by_the_command_line() -> None:
    """Console commands parse whole; a command written inline (``oncekit run --ui``) names a
    command and flags that exist (a capitalised word is a placeholder)."""
    parser = cli.parser()
    commands = [(name, command) for name in console_blocks() for command in console_commands(name)
                if command.startswith("oncekit ")]
    assert len(commands) >= 8, commands
    for where, line in commands:
        try:
            parser.parse_args(shlex.split(line, comments=True)[1:])
        except SystemExit:
            pytest.fail(f"{where}: the command line refuses {line!r}")
    inline = [(page.name, found.split()) for page in sorted(DOCS.glob("*.md"))
              for found in INLINE_COMMAND.findall(page.read_text())]
    assert len(inline) >= 30, inline
    for where, words in inline:
        command = parser
        for word in words[1:]:
            if word.isupper() or not (word.startswith("-") or command is parser or subcommands(command)):
                continue
            if word.startswith("-"):
                assert word.split("=")[0] in command._option_string_actions, f"{where}: {' '.join(words)}: no {word}"
            else:
                assert word in subcommands(command), f"{where}: {' '.join(words)}: no command {word!r}"
                command = subcommands(command)[word]


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next((dict(action.choices) for action in parser._actions
                 if isinstance(action, argparse._SubParsersAction)), {})


def test_python_blocks_written_in_pages_compile() -> None:
    for page, text in blocks("python"):
        compile(text, page, "exec")


def test_every_message_the_troubleshooting_page_quotes_is_one_the_kit_says() -> None:
    """Each bold quote of the troubleshooting page (``...`` for what varies) is text of the kit's
    own messages, so the page cannot drift from what a user sees."""
    root = DOCS.parent
    source = "".join(path.read_text() for folder in ("core", "sinks", "sources", "connectors", "status", "verify")
                     for path in (root / folder).rglob("*.py"))
    source += "".join((root / name).read_text() for name in ("runner.py", "cli.py", "savepoints.py"))
    source = re.sub(r'"\s*\n\s*f?"', "", source)  # adjacent literals of one message, joined
    quotes = re.findall(r"\*\*`([^`]+)`\*\*", (DOCS / "troubleshooting.md").read_text())
    assert len(quotes) >= 10
    missing = [quote for quote in quotes
               if not all(piece.strip() in source for piece in quote.split("...") if piece.strip())]
    assert missing == []


def test_no_user_page_cites_a_test_file_or_a_profilers_samples() -> None:
    """The user's pages say what the kit does; which test shows it and what a profiler counted
    belong on the Design and Benchmarks pages (the engineering log)."""
    engineering = {"design.md", "benchmarks.md"}
    found = []
    for page in [*sorted(DOCS.glob("*.md")), DOCS.parent / "README.md"]:
        if page.name in engineering:
            continue
        for number, line in enumerate(page.read_text().splitlines(), 1):
            if line.startswith("```{literalinclude}"):
                continue  # an example shown, not a test cited
            if re.search(r"tests/\S+\.py|test_\w+\.py|py-spy samples|\d samples per", line):
                found.append(f"{page.name}:{number}: {line.strip()}")
    assert found == []


def test_the_readmes_benchmark_rows_are_the_benchmarks_pages() -> None:
    """A figure has one source: each row of the README's benchmark tables is a row of the last
    run's report that the benchmarks page includes (``make bench``'s own Markdown), word for word."""
    readme = (DOCS.parent / "README.md").read_text()
    section = readme.split("## Benchmarks", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| pair ")]
    page = (DOCS / "benchmarks.md").read_text()
    included = re.findall(r"```\{include\} (\S+)", page)
    assert included[0] == "bench/last-run.md" and all(name.startswith("bench/") for name in included), included
    report = set((DOCS / included[0]).read_text().splitlines())
    assert rows and [row for row in rows if row not in report] == []
