"""Fixtures of the page's tests: a tiny model's config.json, a real `memfit ui` server, a browser."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
from ui_helpers import CHROMIUM_FLAGS, TINY, Server, chromium_path


@pytest.fixture
def tiny_config(tmp_path) -> Path:
    folder = tmp_path / "tiny"
    folder.mkdir()
    path = folder / "config.json"
    path.write_text(json.dumps(TINY))
    return path


@pytest.fixture(scope="module")
def server():
    started = Server()
    yield started
    started.stop()


@pytest.fixture(scope="module")
def browser_page():
    """A page of Debian's chromium driven by Playwright (skipped where either is missing)."""
    sync_api = pytest.importorskip("playwright.sync_api")
    executable = chromium_path()
    if executable is None:
        pytest.skip("chromium is not installed (apt-get install chromium)")
    with tempfile.TemporaryDirectory(prefix="memfit-ui-browser-") as profile, sync_api.sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            profile,
            executable_path=executable,
            headless=True,
            args=CHROMIUM_FLAGS[1:],
            viewport={"width": 1400, "height": 900},
        )
        page = context.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda err: errors.append(str(err)))
        page.errors = errors
        yield page
        context.close()
