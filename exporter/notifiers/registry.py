"""The notifier kinds by the config's `type`: adding a kind is its module and one entry here.

A kind's module holds its config model (whose `type` literal is its key here), its messages and how
they are sent; the config's schema reads the models from `KINDS`, the dispatcher the senders.
"""

from __future__ import annotations

from typing import Any

from exporter.notifiers import alertmanager, email, pagerduty, slack, webhook
from exporter.notifiers.kind import NotifierModel, OutboxKind, ResendKind

Kind = OutboxKind[Any] | ResendKind[Any]

KINDS: dict[str, Kind] = {
    "alertmanager": alertmanager.KIND,
    "webhook": webhook.KIND,
    "slack": slack.KIND,
    "pagerduty": pagerduty.KIND,
    "email": email.KIND,
}


def kind(notifier: NotifierModel) -> Kind:
    return KINDS[notifier.type]


def outbox(notifier: NotifierModel) -> OutboxKind[Any] | None:
    """The notifier's kind if its notifications wait in the outbox, else None (it is resent)."""
    found = KINDS[notifier.type]
    return found if isinstance(found, OutboxKind) else None


def no_digest(found: Kind) -> str:
    """Why a kind takes no digest, after the notifier's name; "" if it takes one."""
    if isinstance(found, OutboxKind) and found.digest is not None:
        return ""
    return found.no_digest
