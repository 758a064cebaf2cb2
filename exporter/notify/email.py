"""The `email` kind: one message (plain text and HTML) per alert group, and the digest, by SMTP.

Every attempt at one notification carries the same Message-ID, so a receiver can drop a repeat
(a server that took the message but whose answer was lost to the deadline gets it again). A
notification goes to the recipients still owed it: one the server refuses for good (5xx) while it
takes the message for others is logged, counted and never tried again; one it refuses for now
(4xx) is retried to that recipient only, holding nothing else back.
"""

from __future__ import annotations

import datetime as dt
import html
import re
from collections.abc import Mapping
from typing import Any

from exporter import digest as digests
from exporter.logs import get_logger
from exporter.notify import smtp
from exporter.notify.kind import Attempt, Delivery, OutboxKind
from exporter.notify.smtp import line
from exporter.schema import EmailNotifier
from exporter.state import GroupEvent, OutboxEntry

log = get_logger(__name__)

ALERTS = 20
"""Alerts a message lists in full; the rest are counted ("and N more")."""
SUBJECT = 200
"""The longest subject, in characters (a summary may be any length)."""
DOMAIN = "inference-cost-exporter"
"""The right-hand side of the Message-IDs made here."""


def _when(timestamp: float) -> str:
    return dt.datetime.fromtimestamp(timestamp, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def message_id(dedup_key: str, entry: int) -> str:
    """The Message-ID of one outbox notification: the same on every attempt to deliver it."""
    key = re.sub(r"[^A-Za-z0-9-]", "", dedup_key)[:64] or "alert"
    return f"<{key}.{entry}@{DOMAIN}>"


def alert_message(event: GroupEvent, external_url: str) -> tuple[str, str, str]:
    """Subject, plain text and HTML for one group event: its status and rule, then each alert's
    summary, labels and start (at most ALERTS of them, and how many more), and a link to the
    exporter. Everything from the alerts is escaped in the HTML: labels and annotations may hold
    anything."""
    status, name = event["status"].upper(), event["alertname"]
    alerts, total = event["alerts"], event["total"]
    if total == 1 and alerts:
        headline = f"[{status}] {name}: {alerts[0]['annotations'].get('summary', name)}"
    else:
        headline = f"[{status}] {name}: {total} alerts"
    subject = line(headline)
    if len(subject) > SUBJECT:
        subject = subject[: SUBJECT - 1] + "…"
    shown = alerts[:ALERTS]
    more = total - len(shown)
    link = f"{external_url}/"

    text = [line(headline), ""]
    items = []
    for alert in shown:
        summary = alert["annotations"].get("summary", alert["key"])
        labels = ", ".join(f"{k}={v}" for k, v in sorted(alert["labels"].items()) if k != "alertname")
        since = f"since {_when(alert['starts_at'])}"
        if alert["ends_at"] is not None and alert["status"] != "firing":
            since += f", resolved {_when(alert['ends_at'])}"
        text += [f"- {line(summary)}", f"  {line(labels) or 'no labels'}", f"  {since}"]
        items.append(
            f"<li><strong>{html.escape(summary)}</strong><br>"
            f"<code>{html.escape(labels or 'no labels')}</code><br>"
            f"<small>{html.escape(since)}</small></li>"
        )
    if more > 0:
        text.append(f"and {more} more")
    text += ["", f"Exporter: {link}", ""]
    body = [
        "<!DOCTYPE html>",
        '<html><head><meta charset="utf-8"></head><body>',
        f"<h2>{html.escape(headline)}</h2>",
        "<ul>",
        *items,
        "</ul>",
        f"<p>and {more} more</p>" if more > 0 else "",
        f'<p><a href="{html.escape(link)}">{html.escape(link)}</a></p>',
        "</body></html>",
        "",
    ]
    return subject, "\n".join(text), "\n".join(line for line in body if line)


def _deliver(
    notifier: EmailNotifier, message: tuple[str, str, str], key: str, entry: OutboxEntry, via: Delivery
) -> Attempt:
    """(subject, text, HTML) by SMTP, with a Message-ID the same on every attempt of this entry,
    to the recipients still owed it."""
    subject, text, html_body = message
    name = notifier.name
    recipients = [r for r in entry.recipients if r in notifier.to] if entry.recipients else list(notifier.to)
    if not recipients:
        return Attempt(None)  # those it was still owed to have left `to` since
    sent = smtp.send(
        notifier,
        subject,
        text,
        html_body,
        message_id=message_id(key, entry.id),
        deadline=via.deadline,
        recipients=recipients,
    )
    if sent.reason is not None:
        return Attempt(via.outcome(name, sent.reason))
    via.outcome(name, None)
    owed = []
    for address, code in sorted(sent.refused.items()):
        first = via.failed_at(name, address)
        if 500 <= code < 600:
            if first:
                log.error("email recipient refused a notification for good; it is not sent to them again",
                          notifier=name, recipient=address, reason=f"SMTP {code}")  # fmt: skip
            continue
        owed.append(address)
        if first:
            log.warning("email recipient refused the notification for now; retried to them only",
                        notifier=name, recipient=address, reason=f"SMTP {code}")  # fmt: skip
    for address in set(recipients) - set(sent.refused):
        if via.recovered_at(name, address):
            log.info("email recipient took a notification again", notifier=name, recipient=address)
    if owed:
        return Attempt(f"SMTP {min(sent.refused[a] for a in owed)} (recipients refused: {len(owed)})", tuple(owed))
    return Attempt(None)


def send(notifier: EmailNotifier, entry: OutboxEntry, via: Delivery) -> Attempt:
    event = entry.event
    return _deliver(notifier, alert_message(event, via.external_url), event["dedup_key"], entry, via)


def digest(notifier: EmailNotifier, body: Mapping[str, Any], entry: OutboxEntry, via: Delivery) -> Attempt:
    message = digests.subject(body), digests.text(body), digests.html(body)
    return _deliver(notifier, message, f"digest-{body.get('id') or body['day']}", entry, via)


KIND = OutboxKind(send=send, digest=digest)
