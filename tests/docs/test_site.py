"""The documentation site: it builds strictly (every warning and unresolved reference fails),
headless chromium finds every page of its navigation and every image, and every command of its
console blocks is one the ``oncekit`` command line accepts.

The Python examples the pages include run in test_examples.py; a Python block written in a page
itself (none today) is compiled here.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urldefrag, urlparse

import pytest

from oncekit import cli

DOCS = Path(__file__).resolve().parents[2] / "docs"
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
            links = page.eval_on_selector_all("a[href]", "links => links.map(a => a.href)")
            missing += [f"{url}: link {link}" for link in links if link.startswith("file://")
                        and not Path(urlparse(urldefrag(link)[0]).path).exists()]
        browser.close()
    assert missing == []


def test_every_oncekit_command_on_the_site_is_accepted_by_the_command_line() -> None:
    commands = [(page, line[2:]) for page, text in blocks("console") for line in text.splitlines()
                if line.startswith("$ oncekit ")]
    assert len(commands) >= 4, commands
    parser = cli.parser()
    for page, line in commands:
        try:
            parser.parse_args(shlex.split(line, comments=True)[1:])
        except SystemExit:
            pytest.fail(f"{page}: the command line refuses {line!r}")


def test_python_blocks_written_in_pages_compile() -> None:
    for page, text in blocks("python"):
        compile(text, page, "exec")
