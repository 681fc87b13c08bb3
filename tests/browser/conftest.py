"""A real stack on the reference engine and Debian's chromium, headless, driven by Playwright.

Chromium gets a fake camera and, as its microphone, a spoken question (played once, then
silence). Every test leaves a full-page screenshot in OMNI_SCREENSHOT_DIR
(default .artifacts/screenshots/). Without chromium or Playwright the tests skip and say why.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, scaled
from tests.stack import Stack, edge_on

QUESTION = "What is the capital of France?"
#: The microphone's words. Not question.wav: the browser starts capturing at a random phase
#: of the 1 s units, and Whisper tiny.en hears that en-us rendering as "capital and friends"
#: at 4 of 10 offsets (the answer is then about New York). This voice is heard right, or as
#: "capital on France", at 20 of 20 offsets 50 ms apart, and answered with Paris each time.
MICROPHONE_SCENARIO = [("silence", 3.0), ("say", QUESTION, "en"), ("silence", 9.0)]
SCREENSHOT_DIR = Path(os.environ.get("OMNI_SCREENSHOT_DIR") or ROOT / ".artifacts" / "screenshots")


def chromium_path() -> str | None:
    """Debian's chromium (never a browser Playwright would download)."""
    return shutil.which("chromium") or (
        "/usr/bin/chromium" if os.access("/usr/bin/chromium", os.X_OK) else None
    )


def chromium_args(microphone_wav: Path) -> list[str]:
    """Flags for a headless chromium with fake media devices and no autoplay gate."""
    return [
        # A fake camera (a moving test pattern) and microphone, granted without a prompt.
        "--use-fake-device-for-media-stream",
        "--use-fake-ui-for-media-stream",
        # The microphone plays this WAV once, then silence (chromium converts the rate).
        f"--use-file-for-fake-audio-capture={microphone_wav}%noloop",
        # Reply audio starts without a click on an element of the page.
        "--autoplay-policy=no-user-gesture-required",
        # Containers often have a small /dev/shm: chromium's renderers crash on it.
        "--disable-dev-shm-usage",
    ]


@pytest.fixture(scope="package")
def microphone_wav(tmp_path_factory) -> Path:
    """The spoken question as a 16 kHz WAV, rendered by the repo's fixture script."""
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is missing: `bash tools/dev test` installs it")
    from omnifabric.tools.make_fixtures import compose, write_wav

    path = tmp_path_factory.mktemp("microphone") / "question_en.wav"
    write_wav(path, compose(MICROPHONE_SCENARIO, seed=2024))
    return path


@pytest.fixture(scope="package")
def playwright_chromium(microphone_wav) -> Iterator[Any]:
    """One headless chromium for the whole run (pages get their own contexts)."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("Playwright is not installed: `bash tools/dev test` installs the dev extra")
    executable = chromium_path()
    if executable is None:
        pytest.skip(
            "Debian's chromium is not installed: `bash tools/dev test` installs it as root "
            "(apt-get install chromium)"
        )
    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=executable,
            headless=True,
            args=chromium_args(microphone_wav),
            timeout=scaled(60) * 1000,
        )
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture(scope="package")
def stack(reference_fabric, tmp_path_factory) -> Iterator[Stack]:
    """An edge on the run's scheduler and reference worker (2 slots, worker0;
    tests/conftest.py), shared by every browser test; it records sessions for the viewer."""
    log_dir = tmp_path_factory.mktemp("browser-stack")
    s = edge_on(reference_fabric, log_dir, "--record-dir", str(log_dir / "records"))
    yield s
    s.stop()


def http_base(ws_url: str) -> str:
    """http(s)://host:port of an edge from its ws(s)://host:port/v1/realtime URL."""
    return ws_url.split("/v1/")[0].replace("ws", "http", 1)


@dataclass
class BrowserPage:
    """A page in its own browser context, with what went wrong in it collected."""

    page: Any
    name: str
    page_errors: list[str] = field(default_factory=list)
    console_errors: list[str] = field(default_factory=list)
    failed_requests: list[str] = field(default_factory=list)
    screenshot: Path | None = None

    def omni(self) -> Any:
        """The page's window.omni as JSON data (None before the page set it)."""
        return self.page.evaluate(
            "() => window.omni ? JSON.parse(JSON.stringify(window.omni)) : null"
        )

    def wait(self, predicate_js: str, what: str, timeout_s: float) -> None:
        """Wait until `predicate_js` (a JS function of omni) is true; on timeout fail with
        the page's state, its errors and what the console said."""
        from playwright.sync_api import TimeoutError as PlaywrightTimeout

        expression = (
            f"() => {{ const omni = window.omni; return !!omni && ({predicate_js})(omni); }}"
        )
        try:
            self.page.wait_for_function(expression, timeout=scaled(timeout_s) * 1000, polling=100)
        except PlaywrightTimeout:
            raise AssertionError(
                f"{self.name}: not {what} within {scaled(timeout_s):.0f} s\n"
                f"window.omni = {summary(self.omni())}\n"
                f"page errors: {self.page_errors}\nconsole errors: {self.console_errors}\n"
                f"failed requests: {self.failed_requests}"
            ) from None

    def shot(self) -> Path:
        """Save a full-page screenshot named after the test and print its path."""
        SCREENSHOT_DIR.mkdir(parents=True, exist_ok=True)
        path = SCREENSHOT_DIR / f"{self.name}.png"
        self.page.screenshot(path=str(path), full_page=True)
        self.screenshot = path
        print(f"\nscreenshot: {path}")
        return path


def summary(state: Any, limit: int = 1500) -> str:
    """window.omni for a failure message, without the bulky per-unit timings."""
    if isinstance(state, dict) and "timings" in state:
        state = {**state, "timings": f"[{len(state['timings'])} entries]"}
    text = json.dumps(state)
    return text if len(text) <= limit else text[:limit] + "..."


@pytest.fixture
def open_page(request, playwright_chromium) -> Iterator[Callable[[str], BrowserPage]]:
    """Opens a URL in a fresh context; at teardown a page the test did not screenshot
    (it failed before) gets one, then the context closes."""
    opened: list[tuple[Any, BrowserPage]] = []

    def opener(url: str, name: str | None = None, init_script: str = "") -> BrowserPage:
        """``init_script``: JavaScript run in the page before its own (to stand in for a
        browser API)."""
        context = playwright_chromium.new_context(viewport={"width": 1280, "height": 900})
        if init_script:
            context.add_init_script(init_script)
        page = context.new_page()
        page.set_default_timeout(scaled(30) * 1000)
        bp = BrowserPage(page, name or request.node.name.removeprefix("test_"))
        page.on("pageerror", lambda exc: bp.page_errors.append(str(exc)))
        page.on(
            "console",
            lambda msg: bp.console_errors.append(msg.text) if msg.type == "error" else None,
        )
        # A missing module or stylesheet shows as a 404 here before anything else breaks.
        page.on(
            "response",
            lambda r: bp.failed_requests.append(f"{r.status} {r.url}") if r.status >= 400 else None,
        )
        page.goto(url)
        opened.append((context, bp))
        return bp

    yield opener
    for context, bp in opened:
        try:
            if bp.screenshot is None:
                bp.shot()
        finally:
            context.close()
