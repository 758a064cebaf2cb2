"""What a notifier kind is: the two ways a kind is delivered to, and what the dispatcher lends it.

A kind is one module of this package (`webhook`, `slack`, …) ending in a `KIND` entry, which the
registry maps from the config's `type`. The dispatcher drives delivery (workers, the outbox,
retries, counters) and never looks at a notifier's kind itself; it asks the kind's entry:

- an `OutboxKind` gets one message per alert group's state change, taken in order from the
  outbox and retried there, and the digest, or says it takes none (and why, for `check`);
- a `ResendKind` is never queued: it is sent every active alert again each `every` seconds, and
  owns the state (Alertmanager).

Each gets a `Delivery`, the dispatcher's side of one send: the exporter's address for links, the
deadline, the POST that counts and logs its outcome, and the per-target failure tally a kind with
several recipients needs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, Protocol, TypeVar

from exporter.core.fields import Name, Strict, url_password

if TYPE_CHECKING:
    from exporter.alerts.alert import Alert
    from exporter.state import OutboxEntry

N = TypeVar("N")
"""A kind's notifier config (its model in `exporter.config.schema`)."""


class NotifierModel(Strict):
    """What every notifier's config has; each kind's model adds its `type` (the key of its kind in
    `exporter.notifiers.registry`) and its fields."""

    name: Name
    if TYPE_CHECKING:
        type: str
        """Each kind's model declares it as a literal: its key in the registry."""

    def plain_secrets(self) -> tuple[str, ...]:
        """Secrets in fields that are not `SecretStr` (a value a URL may carry): here the password
        for basic auth in its `url` or `urls`, whatever its kind."""
        addresses = [getattr(self, "url", None), *getattr(self, "urls", ())]
        return tuple(url_password(url) for url in addresses if isinstance(url, str))


class Attempt(NamedTuple):
    """One delivery attempt: `reason` None when done with (delivered, or nothing to tell this
    notifier), else why it failed (counted and logged already); `owed`, the email recipients a
    retry goes to when others took it already."""

    reason: str | None
    owed: tuple[str, ...] = ()


class Delivery(Protocol):
    """The dispatcher, as a kind sees it while it sends."""

    external_url: str
    """How receivers reach the exporter (links in messages)."""
    deadline: float
    """The longest one exchange with a receiver may take."""

    def post(self, notifier: str, url: str, body: object, target: str = "", address: str | None = None) -> str | None:
        """POST JSON, counted and logged as one delivery of `notifier`; None on a 2xx, else a short
        reason. `target` tells apart the URLs of a notifier that has several, in the log; `address`:
        the IP address of the URL's host to POST to (`core.post.peers`)."""
        ...

    def outcome(self, notifier: str, reason: str | None, target: str = "") -> str | None:
        """Count and log one delivery that did not go through `post`; returns `reason`."""
        ...

    def failed_at(self, notifier: str, target: str) -> bool:
        """Count one failure to `target` (e.g. a recipient); True if it is the first in a row."""
        ...

    def recovered_at(self, notifier: str, target: str) -> bool:
        """`target` took a delivery; True if its last one had failed."""
        ...


class OutboxKind(NamedTuple, Generic[N]):  # (records, not dataclasses: `check` starts without them)
    model: type[NotifierModel]
    """The kind's config (its `type` literal is the kind's key in the registry)."""
    send: Callable[[N, OutboxEntry, Delivery], Attempt]
    """Deliver one alert group's state change (`entry.event`)."""
    digest: Callable[[N, Mapping[str, Any], OutboxEntry, Delivery], Attempt] | None
    """Deliver a digest (`exporter.digest.build`'s body); None for a kind that takes none."""
    no_digest: str = ""
    """Why it takes no digest, after its name (`check` says it for `digest.notifiers`)."""


class ResendKind(NamedTuple, Generic[N]):
    model: type[NotifierModel]
    send: Callable[[N, Sequence[Alert], float, Delivery], None]
    """Send every firing and recently resolved alert (not pending ones) as of a time."""
    every: float
    """Seconds between two sends (sooner when alert states change)."""
    no_digest: str
    """Why it takes no digest, after its name."""


def notification_id(entry: OutboxEntry) -> str:
    """The id of one queued notification, the same on every attempt (and across restarts): its
    rule's incident (`dedup_key`), then the outbox row's number."""
    return f"{entry.event['dedup_key']}-{entry.id}"


def common(mappings: Sequence[Mapping[str, str]]) -> dict[str, str]:
    """The pairs every mapping shares (the group's common labels or annotations)."""
    first, *rest = mappings
    return {k: v for k, v in first.items() if all(m.get(k) == v for m in rest)}


def more(shown: int, total: int) -> str:
    """ "and N more" for the alerts a capped list leaves out; "" when none is."""
    return f"and {total - shown} more" if total > shown else ""
