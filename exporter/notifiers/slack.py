"""The `slack` kind: a message per alert group (text and blocks), and the digest as blocks.

Every name in a message is escaped (`mrkdwn`), since labels and summaries carry names from the
API, and each text is capped at Slack's limit.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

from exporter.core import mrkdwn
from exporter.core.fields import SecretHttpUrl
from exporter.model.events import GroupEvent
from exporter.notifiers import digest as digests
from exporter.notifiers.kind import Attempt, Delivery, NotifierModel, OutboxKind, common, more, notification_id

if TYPE_CHECKING:
    from exporter.state import OutboxEntry


class SlackNotifier(NotifierModel):
    type: Literal["slack"]
    url: SecretHttpUrl


SLACK_ALERTS = 10


def slack_payload(event: GroupEvent, external_url: str, notification: str = "") -> dict[str, Any]:
    """Slack's text and blocks for one group; its context ends with `notification`, the id that is
    the same on every attempt of one notification (Slack takes no id of its own: a message answered
    after the deadline is posted again, and the id shows it is the same one)."""
    status = event["status"].upper()
    name = mrkdwn.escape(event["alertname"])
    alerts, total = event["alerts"], event["total"]
    if total == 1:
        summary = mrkdwn.escape(alerts[0]["annotations"].get("summary", event["alertname"]))
        pairs = sorted(alerts[0]["labels"].items())
        text, detail = f"[{status}] {name}: {summary}", f"*[{status}] {name}*\n{summary}"
    else:
        lines = [f"• {mrkdwn.escape(a['annotations'].get('summary', a['key']))}" for a in alerts[:SLACK_ALERTS]]
        rest = more(len(lines), total)
        pairs = sorted(common([a["labels"] for a in alerts]).items())
        text = f"[{status}] {name}: {total} alerts"
        detail = f"*[{status}] {name}: {total} alerts*\n" + "\n".join(lines) + (f"\n…{rest}" if rest else "")
    labels = ", ".join(f"{mrkdwn.escape(k)}={mrkdwn.escape(v)}" for k, v in pairs if k != "alertname")
    link = f" · <{external_url}/|exporter>" + (f" · notification {mrkdwn.escape(notification)}" if notification else "")
    return {
        "text": mrkdwn.cap(text),
        "blocks": [
            {"type": "section", "text": {"type": "mrkdwn", "text": mrkdwn.cap(detail)}},
            {
                "type": "context",
                "elements": [
                    {"type": "mrkdwn", "text": mrkdwn.cap(labels or "no labels", mrkdwn.TEXT - len(link)) + link}
                ],
            },
        ],
    }


def send(notifier: SlackNotifier, entry: OutboxEntry, via: Delivery) -> Attempt:
    payload = slack_payload(entry.event, via.external_url, notification_id(entry))
    return Attempt(via.post(notifier.name, notifier.url.get_secret_value(), payload))


def digest(notifier: SlackNotifier, body: Mapping[str, Any], entry: OutboxEntry, via: Delivery) -> Attempt:
    return Attempt(via.post(notifier.name, notifier.url.get_secret_value(), digests.slack(body)))


KIND = OutboxKind(model=SlackNotifier, send=send, digest=digest)
