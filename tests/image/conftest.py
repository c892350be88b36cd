"""The built image, for the modules that boot it (`image` tests), and what the fleet ones share:
the releases' bundles and a hub in a network namespace."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import pytest

from tests.image.vm import Hub, build_image, hub_in_namespace, release_bundles, unavailable

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path


@pytest.fixture(scope="module")
def manifest() -> dict[str, Any]:
    """`just image`'s build (kept when its inputs have not changed: modules on other workers
    wait for one build and share it), or a skip saying why it cannot run here."""
    why = unavailable()
    if why is not None:
        pytest.skip(f"image test: {why}")
    return build_image()


@pytest.fixture(scope="module")
def bundles(
    request: pytest.FixtureRequest,
    manifest: dict[str, Any],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Future[dict[str, Path]]]:
    """The bundles of the module's RELEASES (version -> whether it is broken), made in a
    thread while the first boot runs (under TCG the boot is minutes, a bundle one)."""
    releases: dict[str, bool] = request.module.RELEASES
    with ThreadPoolExecutor(1) as pool:
        yield pool.submit(release_bundles, manifest, tmp_path_factory.mktemp("bundles"), releases)


@pytest.fixture
def hub(tmp_path: Path) -> Iterator[Hub]:
    """A hub in a network namespace of its own, and a provisioning file for one node."""
    with hub_in_namespace(tmp_path) as made:
        yield made
