"""Fixtures and hooks for tests/ (the root conftest.py has the collection rules)."""

from __future__ import annotations

import pytest


@pytest.hookimpl(optionalhook=True)
def pytest_timeout_set_timer(item, settings):
    """Each test's timeout, for the rank runners: theirs ends before it (tests/multirank.py)."""
    from tests import multirank

    multirank.set_test_timeout(settings.timeout)
    # None: pytest-timeout sets its own timer next.


@pytest.hookimpl(optionalhook=True)
def pytest_timeout_cancel_timer(item):
    from tests import multirank

    multirank.set_test_timeout(None)
