"""The notifier kinds by the config's `type`: adding a kind is its module and one entry here.

The config's model of the kind goes beside the others in `exporter.schema` (its `type` literal is
the key here), since the schema sits below everything that delivers.
"""

from __future__ import annotations

from typing import Any

from exporter.notify import alertmanager, email, pagerduty, slack, webhook
from exporter.notify.kind import OutboxKind, ResendKind
from exporter.schema import NotifierConfig

Kind = OutboxKind[Any] | ResendKind[Any]

KINDS: dict[str, Kind] = {
    "alertmanager": alertmanager.KIND,
    "webhook": webhook.KIND,
    "slack": slack.KIND,
    "pagerduty": pagerduty.KIND,
    "email": email.KIND,
}


def kind(notifier: NotifierConfig) -> Kind:
    return KINDS[notifier.type]


def outbox(notifier: NotifierConfig) -> OutboxKind[Any] | None:
    """The notifier's kind if its notifications wait in the outbox, else None (it is resent)."""
    found = KINDS[notifier.type]
    return found if isinstance(found, OutboxKind) else None


def no_digest(found: Kind) -> str:
    """Why a kind takes no digest, after the notifier's name; "" if it takes one."""
    if isinstance(found, OutboxKind) and found.digest is not None:
        return ""
    return found.no_digest
