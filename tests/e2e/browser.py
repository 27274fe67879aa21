"""A real headless Chromium (Debian's package) driven by Playwright, for the dashboard's tests."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from playwright.sync_api import Page, sync_playwright

from tests.conftest import installed_binary

CHROMIUM_CANDIDATES = ("/usr/bin/chromium", "/usr/bin/chromium-browser")
# No network beyond loopback here: Chromium's own background connections only fail slowly.
QUIET_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def chromium_binary() -> str:
    """Debian's Chromium."""
    return installed_binary(
        "chromium", CHROMIUM_CANDIDATES, "the dashboard's browser tests need it"
    )


@contextmanager
def chromium_page(width: int = 1400, height: int = 1000) -> Iterator[Page]:
    """A page in a fresh headless Chromium; page errors fail the test when it ends.

    So do Content-Security-Policy violations the console reports: the page must work under
    the policy its server sends. (Wait on conditions written as functions, `() => ...`: a
    condition as a bare expression is run through eval, which that policy forbids.)
    """
    errors: list[str] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium_binary(), args=QUIET_FLAGS)
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            page.on("pageerror", lambda error: errors.append(str(error)))
            page.on(
                "console",
                lambda message: (
                    errors.append(message.text)
                    if "Content Security Policy" in message.text
                    else None
                ),
            )
            yield page
        finally:
            browser.close()
    assert not errors, errors
