"""Fixtures of the image tests: both images built once per session (tests/images/buildah.py)."""

from __future__ import annotations

import pytest

from tests.images.buildah import Buildah

REPOSITORY, TAG = "localhost/mambaserve-test", "test"


@pytest.fixture(scope="session")
def buildah() -> Buildah:
    return Buildah()


@pytest.fixture(scope="session")
def images(buildah: Buildah) -> tuple[str, str]:
    """(server image, operator image), built from this checkout by scripts/build_images.sh."""
    return buildah.build_project_images(REPOSITORY, TAG)
