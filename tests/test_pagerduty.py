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


@pytest.mark.parametrize("summary", ["", "   "])
def test_a_blank_summary_is_the_alert_name_as_pagerduty_requires_one(summary: str) -> None:
    """A summary template that renders to nothing (`{endpoint_id}` of the charges of no endpoint)."""
    event = group("firing")
    event["alerts"][0]["annotations"]["summary"] = summary
    body = pagerduty_payload(event, "rk", "")
    assert body is not None
    assert body["payload"]["summary"] == "SpendHigh"
