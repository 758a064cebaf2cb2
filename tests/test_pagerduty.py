"""The PagerDuty event's severity: one of PagerDuty's four, from the rule's `severity` label in any
case; any other value (or none) is `warning`."""

from __future__ import annotations

import pytest

from exporter.notifiers.pagerduty import pagerduty_payload
from tests.test_email import group


@pytest.mark.parametrize(
    ("label", "severity"),
    [("critical", "critical"), ("Critical", "critical"), ("ERROR", "error"), ("info", "info"), ("page", "warning"),
     (None, "warning")],
)  # fmt: skip
def test_the_severity_label_is_taken_in_any_case(label: str | None, severity: str) -> None:
    body = pagerduty_payload(group("firing", **({} if label is None else {"severity": label})), "rk", "")
    assert body is not None
    assert body["payload"]["severity"] == severity
