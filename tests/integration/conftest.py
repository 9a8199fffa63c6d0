"""Shared by every integration test file, which all run in one pytest process."""

from __future__ import annotations

import gc

import pytest


@pytest.fixture(autouse=True)
def collect_garbage_within_the_test():
    """Objects a test dropped (gRPC channels and servers among them) are finalized at the end of
    that test, while what they refer to still exists, not at some later test's collection."""
    yield
    gc.collect()
