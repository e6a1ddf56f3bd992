"""`harness.missing`: a test whose prerequisite is absent skips, but under
CI (CI=true), whose set-up installs everything, it fails."""

from __future__ import annotations

import pytest
from harness import missing


def test_absent_prerequisites_skip_outside_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="no chromium"):
        missing("no chromium")


def test_absent_prerequisites_fail_in_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="no chromium; CI must run this test"):
        missing("no chromium")
