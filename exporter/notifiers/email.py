"""The `email` kind: one message (plain text and HTML) per alert group, and the digest, by SMTP.

Every attempt at one notification carries the same Message-ID, so a receiver can drop a repeat
(a server that took the message but whose answer was lost to the deadline gets it again). A
notification goes to the recipients still owed it: one the server refuses for good (5xx) while it
takes the message for others is logged, counted and never tried again; one it refuses for now
(4xx) is retried to that recipient only, holding nothing else back.
"""

from __future__ import annotations

import datetime as dt
import os
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any, Literal

from exporter.core.fields import Text
from exporter.core.typed import AfterValidator, Field, SecretStr, model_validator
from exporter.core.words import counted, line, shortened
from exporter.model.events import GroupEvent
from exporter.notifiers import digest as digests
from exporter.notifiers.kind import Attempt, Delivery, NotifierModel, OutboxKind

if TYPE_CHECKING:
    from exporter.state import OutboxEntry


IMPLICIT_TLS_PORT = 465
"""SMTP over TLS from the first byte (RFC 8314's submissions), as Alertmanager takes this port too:
the handshake before the greeting, no STARTTLS."""


def _email_address(value: str) -> str:
    """`someone@example.com` or `Someone <someone@example.com>`."""
    from email.utils import parseaddr  # (here: `check` reads the config without the email package)

    _, address = parseaddr(value)
    if not re.fullmatch(r"[^@\s<>,;]+@[^@\s<>,;]+\.[^@\s<>,;.]+", address):
        raise ValueError(f"{value!r} is not an email address")
    return value


EmailAddress = Annotated[str, AfterValidator(_email_address)]


def _host_port(value: str) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or not host.strip("[]") or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ValueError(f"{value!r} is not HOST:PORT (e.g. smtp.example.com:587)")
    return value


class EmailNotifier(NotifierModel):
    """SMTP: alerts and digests as plain text plus HTML."""

    type: Literal["email"]
    smtp: Annotated[str, AfterValidator(_host_port)]
    from_: EmailAddress = Field(alias="from")
    to: Annotated[tuple[EmailAddress, ...], Field(min_length=1)]
    username: Text | None = None
    password: SecretStr | None = None
    starttls: bool = True
    """Upgrade the connection with STARTTLS (the server's certificate is verified) before anything is
    sent. On port 465 the connection is TLS from the start, whatever this says."""
    ca_file: Text | None = None
    """CA certificates (PEM) to verify the server with, instead of the system's."""

    @model_validator(mode="after")
    def _login(self) -> EmailNotifier:
        if (self.username is None) != (self.password is None):
            raise ValueError("`username` and `password` go together")
        if self.username is not None and not self.starttls and not self.implicit_tls:
            raise ValueError(
                "a login needs `starttls: true`, or port 465 (the password would cross the network in clear)"
            )
        if self.ca_file is not None and not os.path.isfile(self.ca_file):  # (a name too long, or with a NUL: none)
            raise ValueError(f"ca_file {self.ca_file[:200]!r} does not exist")
        return self

    @property
    def host(self) -> str:
        return self.smtp.rpartition(":")[0].strip("[]")

    @property
    def port(self) -> int:
        return int(self.smtp.rpartition(":")[2])

    @property
    def implicit_tls(self) -> bool:
        """TLS from the first byte, no STARTTLS: on IMPLICIT_TLS_PORT."""
        return self.port == IMPLICIT_TLS_PORT


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
    import html  # (here: `check` reads the config without it)

    status, name = event["status"].upper(), event["alertname"]
    alerts, total = event["alerts"], event["total"]
    if total == 1 and alerts:
        headline = f"[{status}] {name}: {alerts[0]['annotations'].get('summary', name)}"
    else:
        headline = f"[{status}] {name}: {counted(total, 'alert')}"
    subject = shortened(line(headline), SUBJECT)
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
    # (logging, smtplib and ssl load with the first email, not with the config: `check` starts without them)
    from exporter.core.logs import get_logger
    from exporter.notifiers import smtp

    log = get_logger(__name__)

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


KIND = OutboxKind(model=EmailNotifier, send=send, digest=digest)
