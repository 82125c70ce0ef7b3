"""CI=true turns a missing tool or environment from a skip into a failure: CI promises that these
tests ran, so a skip there would be a silent pass. Elsewhere the test skips and names the fix."""
from __future__ import annotations

import os

import pytest


def in_ci() -> bool:
    """CI=true (what GitHub Actions and most runners export; 1/yes accepted too)."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def unavailable(what: str, why: str, fix: str):
    """A tool or environment a test needs is not here: fail under CI=true, else skip; both name the fix."""
    message = f"{what} unavailable: {why}. Fix: {fix}"
    if in_ci():
        pytest.fail(f"CI=true, and {message}", pytrace=False)
    pytest.skip(message)
