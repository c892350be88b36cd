"""The built image, for the modules that boot it (`image` tests)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.image.vm import build_image, unavailable


@pytest.fixture(scope="module")
def manifest() -> dict[str, Any]:
    """`just image`'s build (kept when its inputs have not changed: modules on other workers
    wait for one build and share it), or a skip saying why it cannot run here."""
    why = unavailable()
    if why is not None:
        pytest.skip(f"image test: {why}")
    return build_image()
