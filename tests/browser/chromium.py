"""Chromium as the browser tests drive it: where it is, a fresh profile, screenshots kept
as artifacts, and the console's first admin."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from playwright.async_api import Page, async_playwright

from tests.conftest import REPO

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from playwright.async_api import BrowserContext

CHROMIUM = shutil.which("chromium")
ARTIFACTS = Path(os.environ.get("KVL_BROWSER_ARTIFACTS", REPO / "tests" / "browser" / "artifacts"))
PASSWORD = "a long test password"


@contextlib.asynccontextmanager
async def open_browser(profile: Path) -> AsyncIterator[BrowserContext]:
    assert CHROMIUM is not None
    async with async_playwright() as playwright:
        context = await playwright.chromium.launch_persistent_context(
            profile,  # a fresh user data directory
            executable_path=CHROMIUM,
            headless=True,
            args=ARGS,
            ignore_https_errors=True,  # the hub's own CA; the API tests pin it instead
            viewport={"width": 1280, "height": 900},
        )
        try:
            yield context
        finally:
            await context.close()


class Shots:
    def __init__(self, folder: Path) -> None:
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        self.folder = folder
        self.count = 0
        print(f"console screenshots: {folder}")  # noqa: T201 - where the artifacts are

    async def take(self, page: Page, name: str) -> None:
        self.count += 1
        await page.screenshot(path=self.folder / f"{self.count:02d}-{name}.png", full_page=True)


def create_admin(data: str) -> None:
    """The first admin, as an operator makes one: `kvl hub admin create`."""
    made = subprocess.run(
        [sys.executable, "-m", "shared.cli", "hub", "admin", "create", "--name", "ops",
         "--password-stdin", "--data-dir", data],
        input=PASSWORD + "\n", capture_output=True, text=True, cwd=REPO, timeout=120, check=False,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr


ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]  # fmt: skip
