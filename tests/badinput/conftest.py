"""Prints the bad-input catalogue's timing (wall time, workspace builds, slowest cases) in pytest's summary."""

from __future__ import annotations

import pytest

SUMMARY_KEY = pytest.StashKey[list]()
"""``test_catalogue.py`` stores its summary lines here (``config.stash[SUMMARY_KEY]``)."""


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, config: pytest.Config
) -> None:
    lines = config.stash.get(SUMMARY_KEY, [])
    if lines:
        terminalreporter.section("bad-input catalogue")
        for line in lines:
            terminalreporter.write_line(line)
