"""Email notifications: the message itself, then delivery through a real Dispatcher over a real
state file to a real SMTP server on loopback (aiosmtpd) that requires STARTTLS, with a
certificate from a test CA (trustme), and a login; and to scripted servers that stall."""

from __future__ import annotations

import datetime as dt
import json
import logging
import socket
import sqlite3
import ssl
import time
from collections.abc import Sequence
from email import message_from_bytes, policy
from email.message import EmailMessage
from email.parser import BytesParser
from email.policy import default
from pathlib import Path
from typing import Any

import pytest
import trustme
from aiosmtpd.controller import Controller

from exporter.alerts.alert import Alert
from exporter.core.clock import Clock, FrozenClock
from exporter.delivery.dispatcher import BACKOFF_MAX, GIVE_UP_AFTER, Dispatcher
from exporter.model.events import GroupEvent
from exporter.notifiers import email, smtp
from exporter.notifiers.email import EmailNotifier
from exporter.notifiers.smtp import Sent, build
from exporter.state import AlertStore, StateStore
from tests.helpers import LoopbackServer, free_port, logged, wait_for
from tests.smtp import FROM, PASSWORD, TO, USER, Mailbox, Start, server_tls

EXTERNAL_URL = "http://exporter.example:9877"
INCIDENT = "0123456789abcdef"
STARTED = dt.datetime(2026, 11, 22, 1, 50, tzinfo=dt.UTC).timestamp()
DUE_AGAIN = dt.timedelta(seconds=BACKOFF_MAX * 1.2 + 1)
"""Past the longest backoff: a failed notification is due again."""


# -- the message --


def group(status: str = "firing", count: int = 1, **labels: str) -> GroupEvent:
    """A rule's group event as the engine queues it: `count` alerts that changed to `status`."""
    alerts = [
        Alert(
            f"key-{n}", "rule", {"alertname": "SpendHigh", "endpoint_id": f"ep-{n}", **labels},
            {"summary": f"ep-{n} spent 12.00 today (over 10.00)"}, status,  # type: ignore[arg-type]
            STARTED, "12.00", STARTED, fired_at=STARTED,
            resolved_at=STARTED + 600 if status == "resolved" else None,
        ).event(status)
        for n in range(count)
    ]  # fmt: skip
    return {
        "status": status,
        "alertname": "SpendHigh",
        "dedup_key": INCIDENT,
        "alerts": alerts[:100],
        "total": count,
        "still_firing": count if status == "firing" else 0,
    }


def test_a_message_lists_the_alerts_with_their_labels_start_and_a_link() -> None:
    subject, text, html = email.alert_message(group(), EXTERNAL_URL)
    assert subject == "[FIRING] SpendHigh: ep-0 spent 12.00 today (over 10.00)"
    assert "ep-0 spent 12.00 today (over 10.00)" in text
    assert "endpoint_id=ep-0" in text
    assert "since 2026-11-22 01:50:00 UTC" in text
    assert f"{EXTERNAL_URL}/" in text
    assert f'<a href="{EXTERNAL_URL}/">' in html
    resolved = email.alert_message(group("resolved"), EXTERNAL_URL)
    assert resolved[0].startswith("[RESOLVED] SpendHigh")
    assert "resolved 2026-11-22 02:00:00 UTC" in resolved[1]


def test_a_big_group_is_counted_not_listed() -> None:
    subject, text, html = email.alert_message(group(count=250), EXTERNAL_URL)
    assert subject == "[FIRING] SpendHigh: 250 alerts"
    assert text.count("endpoint_id=ep-") == email.ALERTS
    assert f"and {250 - email.ALERTS} more" in text
    assert html.count("<li>") == email.ALERTS
    assert f"and {250 - email.ALERTS} more" in html


def test_labels_and_annotations_are_escaped_and_the_subject_is_one_line() -> None:
    event = group(team='<script>alert("x")</script> & co')
    event["alerts"][0]["annotations"]["summary"] = "<b>spent</b>\r\nBcc: victim@example.com"
    subject, text, html = email.alert_message(event, EXTERNAL_URL)
    assert "\n" not in subject
    assert "\r" not in subject
    assert subject == "[FIRING] SpendHigh: <b>spent</b> Bcc: victim@example.com"
    assert "<script>" not in html
    assert "<b>" not in html
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt; &amp; co" in html
    assert "&lt;b&gt;spent&lt;/b&gt;" in html
    assert "\nBcc:" not in text  # a summary stays on its line in the text too
    message = build(notifier(1), subject, text, html, "<a@b>")
    assert message["Bcc"] is None
    assert message["Subject"] == subject


def test_a_lone_surrogate_from_the_api_cannot_make_a_message_that_never_sends() -> None:
    event = group(endpoint_id="ep-\ud800-x")  # JSON lets a service send one; UTF-8 cannot carry it
    event["alerts"][0]["annotations"]["summary"] = "ep-\ud800-x spent 12"
    subject, text, html = email.alert_message(event, EXTERNAL_URL)
    raw = build(notifier(1), subject, text, html, "<a@b>").as_bytes()
    assert b"ep-?-x" in raw


def test_a_message_beyond_ascii_goes_in_seven_bit_lines() -> None:
    """Labels and summaries in any script: the body is quoted-printable, so a server that does not
    offer 8BITMIME (RFC 6152) takes it as it is."""
    event = group(team="財務 · équipe")
    event["alerts"][0]["annotations"]["summary"] = "ep-0 spent ¥12.00 today"
    subject, text, html = email.alert_message(event, EXTERNAL_URL)
    raw = build(notifier(1), subject, text, html, "<a@b>").as_bytes()
    assert raw.isascii()
    parsed = message_from_bytes(raw, policy=default)
    assert "財務 · équipe" in parsed.get_body(("plain",)).get_content()  # type: ignore[union-attr]


def test_message_ids_are_stable_per_notification_and_differ_between_them() -> None:
    first = email.message_id(INCIDENT, 7)
    assert first == email.message_id(INCIDENT, 7) == f"<{INCIDENT}.7@inference-cost-exporter>"
    assert email.message_id(INCIDENT, 8) != first
    assert email.message_id("odd <key>@x", 1) == "<oddkeyx.1@inference-cost-exporter>"


def notifier(port: int, **overrides: object) -> EmailNotifier:
    document = {
        "name": "mail", "type": "email", "smtp": f"127.0.0.1:{port}", "from": FROM, "to": TO,
        "username": USER, "password": PASSWORD,
    } | overrides  # fmt: skip
    return EmailNotifier.model_validate({k: v for k, v in document.items() if v is not None})


@pytest.fixture
def alert_store(store: StateStore) -> AlertStore:
    """The alert tables of a real state file (tmp_path/state.db)."""
    return AlertStore(store)


def dispatcher_for(notifier: EmailNotifier, alert_store: AlertStore, clock: Clock) -> Dispatcher:
    return Dispatcher([notifier], alert_store, clock, lambda _: [], EXTERNAL_URL)


def queue(alert_store: AlertStore, clock: Clock, event: GroupEvent) -> None:
    """Queue `event` with its alerts' new state, in one transaction, as the engine does (a
    notification whose alerts are no longer in its state is never delivered)."""
    with alert_store.store.transaction() as db:
        for alert in event["alerts"]:
            alert_store.save_state(db, alert["key"], "rule", json.dumps({"state": event["status"]}))
        alert_store.enqueue(db, "mail", event, clock.now().timestamp())


def outbox(tmp_path: Path) -> list[tuple[int, int, float | None, str]]:
    """(id, attempts, delivered, last_error) of every outbox row, as the state file holds them."""
    with sqlite3.connect(tmp_path / "state.db") as db:
        return db.execute("SELECT id, attempts, delivered, last_error FROM outbox ORDER BY id").fetchall()


def assert_no_secret(caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    """Neither the password nor the username in the exporter's log lines or the stored reasons."""
    for record in caplog.records:
        if record.name.startswith("exporter"):
            line = f"{record.getMessage()} {getattr(record, 'fields', {})}"
            assert PASSWORD not in line
            assert USER not in line
    for *_, reason in outbox(tmp_path):
        assert PASSWORD not in reason
        assert USER not in reason


# -- what the dispatcher hands to SMTP: each message built by `build`, without a server --


class Outgoing:
    """Stands in for `smtp.send`: builds each message with the real `build`, keeps it as a server
    parses it, with the recipients it went to, and answers from `answers` (in order; then: taken)."""

    def __init__(self) -> None:
        self.sent: list[tuple[EmailMessage, list[str]]] = []
        self.answers: list[Sent] = []

    def __call__(
        self, notifier: EmailNotifier, subject: str, text: str, html: str, *, message_id: str, deadline: float,
        recipients: Sequence[str] = (),
    ) -> Sent:  # fmt: skip
        raw = build(notifier, subject, text, html, message_id).as_bytes()
        message = BytesParser(policy=policy.default).parsebytes(raw)
        assert isinstance(message, EmailMessage)
        self.sent.append((message, list(recipients or notifier.to)))
        return self.answers.pop(0) if self.answers else Sent(None)


@pytest.fixture
def outgoing(monkeypatch: pytest.MonkeyPatch) -> Outgoing:
    fake = Outgoing()
    monkeypatch.setattr(smtp, "send", fake)
    return fake


def content(message: EmailMessage) -> tuple[list[tuple[str, str]], str, list[tuple[str, str]]]:
    """A message's headers but those made afresh each time it is built (its Date, its MIME
    boundary), its content type, and its parts."""
    headers = [(k, str(v)) for k, v in message.items() if k not in ("Date", "Content-Type")]
    parts = [(p.get_content_type(), p.get_content()) for p in message.iter_parts()]
    return headers, message.get_content_type(), parts


def test_firing_then_resolved_go_as_text_then_html_to_everyone_each_under_its_own_message_id(
    outgoing: Outgoing, alert_store: AlertStore, clock: Clock, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="exporter")
    dispatcher = dispatcher_for(notifier(1), alert_store, clock)
    queue(alert_store, clock, group("firing"))
    assert dispatcher.deliver() == 1
    queue(alert_store, clock, group("resolved"))
    assert dispatcher.deliver() == 1
    assert dispatcher.deliver() == 0

    (message, to), (resolved, _) = outgoing.sent
    assert to == TO
    assert message["Subject"] == "[FIRING] SpendHigh: ep-0 spent 12.00 today (over 10.00)"
    assert resolved["Subject"].startswith("[RESOLVED] SpendHigh")
    assert message["From"] == FROM
    assert message["To"] == ", ".join(TO)
    assert message["Date"] is not None
    assert message.get_content_type() == "multipart/alternative"
    parts = list(message.iter_parts())
    assert [p.get_content_type() for p in parts] == ["text/plain", "text/html"]
    assert "endpoint_id=ep-0" in parts[0].get_content()
    assert f'<a href="{EXTERNAL_URL}/">' in parts[1].get_content()
    (first_id, *_), (second_id, *_) = outbox(tmp_path)
    assert message["Message-ID"] == email.message_id(INCIDENT, first_id)
    assert resolved["Message-ID"] == email.message_id(INCIDENT, second_id) != message["Message-ID"]
    assert dispatcher.sent == {"mail": 2}
    assert dispatcher.failed == {"mail": 0}
    assert not logged(caplog.records, "notification failed")


def test_a_retry_is_the_same_message_under_the_same_message_id_after_its_backoff(
    outgoing: Outgoing, alert_store: AlertStore, clock: Clock, frozen: FrozenClock, tmp_path: Path
) -> None:
    outgoing.answers = [Sent("SMTP 451 (message refused)")]
    dispatcher = dispatcher_for(notifier(1), alert_store, clock)
    queue(alert_store, clock, group())
    assert dispatcher.deliver() == 0
    ((entry, attempts, _, reason),) = outbox(tmp_path)
    assert (attempts, reason) == (1, "SMTP 451 (message refused)")
    assert dispatcher.deliver() == 0  # not before its backoff
    assert len(outgoing.sent) == 1
    frozen.advance(DUE_AGAIN)
    assert dispatcher.deliver() == 1
    frozen.advance(DUE_AGAIN)
    assert dispatcher.deliver() == 0
    (refused, to), (taken, again) = outgoing.sent
    assert to == again == TO
    assert refused["Message-ID"] == taken["Message-ID"] == email.message_id(INCIDENT, entry)
    assert content(refused) == content(taken)
    assert dispatcher.sent == {"mail": 1}
    assert dispatcher.failed == {"mail": 1}


def test_a_retry_to_the_recipients_still_owed_goes_to_them_only_and_names_everyone(
    outgoing: Outgoing, alert_store: AlertStore, clock: Clock, frozen: FrozenClock, tmp_path: Path
) -> None:
    to = ["ops@example.com", "oncall@example.com"]
    outgoing.answers = [Sent(None, {"ops@example.com": 450})]  # taken for oncall only
    dispatcher = dispatcher_for(notifier(1, to=to), alert_store, clock)
    queue(alert_store, clock, group("firing"))
    assert dispatcher.deliver() == 0  # not done with: one recipient is still owed it
    ((_, attempts, delivered, reason),) = outbox(tmp_path)
    assert (attempts, delivered, reason) == (1, None, "SMTP 450 (recipients refused: 1)")
    frozen.advance(DUE_AGAIN)
    assert dispatcher.deliver() == 1
    frozen.advance(DUE_AGAIN)
    assert dispatcher.deliver() == 0
    assert [recipients for _, recipients in outgoing.sent] == [to, ["ops@example.com"]]
    (first, _), (second, _) = outgoing.sent
    assert first["Message-ID"] == second["Message-ID"]
    assert first["To"] == second["To"] == ", ".join(to)  # the header names everyone, as it should
    assert content(first) == content(second)
    assert dispatcher.failed == {"mail": 1}


def test_a_recipient_owed_a_message_and_then_taken_out_of_to_is_not_sent_it(
    outgoing: Outgoing, alert_store: AlertStore, clock: Clock, frozen: FrozenClock
) -> None:
    to = ["full@example.com", "oncall@example.com"]
    outgoing.answers = [Sent(None, {"full@example.com": 452})]  # a full mailbox; oncall took it
    dispatcher = dispatcher_for(notifier(1, to=to), alert_store, clock)
    queue(alert_store, clock, group("firing"))
    dispatcher.deliver()
    assert dispatcher.pending() == {"mail": 1}
    dispatcher.configure([notifier(1, to=["oncall@example.com"])], EXTERNAL_URL)
    frozen.advance(DUE_AGAIN)
    dispatcher.deliver()
    assert [recipients for _, recipients in outgoing.sent] == [to]  # once: it reached oncall alone
    assert dispatcher.pending() == {}


# -- over SMTP: a real server on loopback --


@pytest.mark.integration
def test_firing_then_resolved_arrive_as_text_and_html_over_tls_after_a_login(
    start_smtp: Start, mailbox: Mailbox, ca_file: str, alert_store: AlertStore, clock: Clock, tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    caplog.set_level(logging.DEBUG, logger="exporter")
    server = start_smtp()
    dispatcher = dispatcher_for(notifier(server.port, ca_file=ca_file), alert_store, clock)
    queue(alert_store, clock, group("firing"))
    assert dispatcher.deliver() == 1
    queue(alert_store, clock, group("resolved"))
    assert dispatcher.deliver() == 1
    assert dispatcher.deliver() == 0

    firing, resolved = mailbox.messages
    assert [m.tls for m in mailbox.messages] == [True, True]  # STARTTLS was used
    assert [m.login for m in mailbox.messages] == [USER, USER]
    assert mailbox.mails == [True, True]  # nothing went in clear
    assert firing.mail_from == "exporter@example.com"
    assert firing.rcpt_tos == TO
    message = firing.message  # arrived whole (its headers and parts: the unit test above)
    assert message["Subject"] == "[FIRING] SpendHigh: ep-0 spent 12.00 today (over 10.00)"
    assert resolved.message["Subject"].startswith("[RESOLVED] SpendHigh")
    assert [p.get_content_type() for p in message.iter_parts()] == ["text/plain", "text/html"]
    (first_id, *_), (second_id, *_) = outbox(tmp_path)
    assert message["Message-ID"] == email.message_id(INCIDENT, first_id)
    assert resolved.message["Message-ID"] == email.message_id(INCIDENT, second_id) != message["Message-ID"]
    assert dispatcher.sent == {"mail": 2}
    assert dispatcher.failed == {"mail": 0}
    assert not logged(caplog.records, "notification failed")
    assert_no_secret(caplog, tmp_path)


@pytest.mark.integration
def test_a_wrong_password_fails_without_naming_it_is_retried_and_never_dropped(
    start_smtp: Start, mailbox: Mailbox, ca_file: str, alert_store: AlertStore, clock: Clock,
    frozen: FrozenClock, tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    caplog.set_level(logging.DEBUG, logger="exporter")
    server = start_smtp()
    wrong = notifier(server.port, ca_file=ca_file, password="not-the-" + PASSWORD)
    dispatcher = dispatcher_for(wrong, alert_store, clock)
    queue(alert_store, clock, group())
    for _ in range(GIVE_UP_AFTER + 1):  # a login refused is not this message's fault: it is kept
        assert dispatcher.deliver() == 0
        frozen.advance(DUE_AGAIN)
    ((_, attempts, delivered, reason),) = outbox(tmp_path)
    assert (attempts, delivered) == (GIVE_UP_AFTER + 1, None)
    assert reason == "login refused (SMTP 535)"
    assert len(mailbox.logins) >= GIVE_UP_AFTER + 1
    assert not any(mailbox.logins)
    assert mailbox.mails == []
    assert dispatcher.failed == {"mail": GIVE_UP_AFTER + 1}
    (failure,) = logged(caplog.records, "notification failed")  # once, not on every retry
    assert failure.fields == {"notifier": "mail", "reason": "login refused (SMTP 535)"}  # type: ignore[attr-defined]
    assert_no_secret(caplog, tmp_path)
    assert "not-the-" not in caplog.text

    dispatcher.configure([notifier(server.port, ca_file=ca_file)], EXTERNAL_URL)  # the password fixed
    assert dispatcher.deliver() == 1
    assert len(mailbox.messages) == 1
    assert logged(caplog.records, "notifier recovered", notifier="mail")


@pytest.mark.integration
def test_a_temporary_refusal_is_retried_with_the_same_message_id_and_delivered_once(
    start_smtp: Start, mailbox: Mailbox, ca_file: str, alert_store: AlertStore, clock: Clock,
    frozen: FrozenClock, tmp_path: Path,
) -> None:  # fmt: skip
    server = start_smtp()
    mailbox.data_replies = ["451 4.3.0 Try again later"]
    dispatcher = dispatcher_for(notifier(server.port, ca_file=ca_file), alert_store, clock)
    queue(alert_store, clock, group())
    assert dispatcher.deliver() == 0
    ((_, attempts, _, reason),) = outbox(tmp_path)
    assert (attempts, reason) == (1, "SMTP 451 (message refused)")
    assert dispatcher.deliver() == 0  # not before its backoff
    assert len(mailbox.attempts) == 1
    frozen.advance(DUE_AGAIN)
    assert dispatcher.deliver() == 1
    frozen.advance(DUE_AGAIN)
    assert dispatcher.deliver() == 0
    assert len(mailbox.messages) == 1
    refused, taken = mailbox.attempts
    assert refused["Message-ID"] == taken["Message-ID"] == mailbox.messages[0].message["Message-ID"]
    assert dispatcher.sent == {"mail": 1}
    assert dispatcher.failed == {"mail": 1}


@pytest.mark.integration
def test_a_permanent_refusal_is_dropped_after_the_last_attempt_and_the_queue_moves_on(
    start_smtp: Start, mailbox: Mailbox, ca_file: str, alert_store: AlertStore, clock: Clock,
    frozen: FrozenClock, tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    caplog.set_level(logging.INFO, logger="exporter")
    server = start_smtp()
    mailbox.rcpt_replies = ["550 5.1.1 No such mailbox"] * GIVE_UP_AFTER
    dispatcher = dispatcher_for(notifier(server.port, ca_file=ca_file, to=["nobody@example.com"]), alert_store, clock)
    refused = group("firing")
    refused["alerts"][0]["key"] = "another-alert"  # still firing when the other resolves
    queue(alert_store, clock, refused)
    queue(alert_store, clock, group("resolved"))
    for _ in range(GIVE_UP_AFTER - 1):
        assert dispatcher.deliver() == 0
        frozen.advance(DUE_AGAIN)
    assert dispatcher.deliver() == 1  # the last attempt drops the first; the second goes through
    (_, attempts, dropped_at, reason), (_, _, delivered, _) = outbox(tmp_path)
    assert (attempts, reason) == (GIVE_UP_AFTER, "SMTP 550 (recipient refused)")
    assert dropped_at is not None
    assert delivered is not None
    assert [m.message["Subject"].split("]")[0] for m in mailbox.messages] == ["[RESOLVED"]
    assert mailbox.attempts == [mailbox.messages[0].message]  # a refused recipient: no data was sent
    (dropped,) = logged(caplog.records, "notification dropped", notifier="mail")
    assert dropped.fields["attempts"] == GIVE_UP_AFTER  # type: ignore[attr-defined]


@pytest.mark.integration
def test_a_recipient_refused_for_now_gets_the_message_later_and_the_others_only_once(
    start_smtp: Start, mailbox: Mailbox, ca_file: str, alert_store: AlertStore, clock: Clock,
    frozen: FrozenClock, tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    caplog.set_level(logging.INFO, logger="exporter")
    server = start_smtp()
    mailbox.rcpt_replies = ["450 4.2.1 Mailbox busy, try again later"]  # the first recipient, once
    to = ["ops@example.com", "oncall@example.com"]
    dispatcher = dispatcher_for(notifier(server.port, ca_file=ca_file, to=to), alert_store, clock)
    queue(alert_store, clock, group("firing"))
    assert dispatcher.deliver() == 0  # not done with: one recipient is still owed it
    assert [m.rcpt_tos for m in mailbox.messages] == [["oncall@example.com"]]
    ((_, attempts, delivered, reason),) = outbox(tmp_path)
    assert (attempts, delivered, reason) == (1, None, "SMTP 450 (recipients refused: 1)")
    (refused,) = logged(caplog.records, "email recipient refused the notification for now; retried to them only")
    assert refused.fields["recipient"] == "ops@example.com"  # type: ignore[attr-defined]
    frozen.advance(DUE_AGAIN)
    assert dispatcher.deliver() == 1
    frozen.advance(DUE_AGAIN)
    assert dispatcher.deliver() == 0
    assert [m.rcpt_tos for m in mailbox.messages] == [["oncall@example.com"], ["ops@example.com"]]
    first, second = (m.message for m in mailbox.messages)
    assert first["Message-ID"] == second["Message-ID"]
    assert first["To"] == second["To"] == ", ".join(to)  # the header names everyone, as it should
    assert dispatcher.failed == {"mail": 1}
    assert logged(caplog.records, "email recipient took a notification again", recipient="ops@example.com")


@pytest.mark.integration
def test_on_port_465_tls_comes_first_and_the_login_and_message_go_over_it(
    start_smtp: Start, mailbox: Mailbox, ca_file: str, alert_store: AlertStore, clock: Clock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """SMTPS: the handshake before the greeting, no STARTTLS. The test server cannot take port 465:
    the port that means it is the server's, here."""
    server = start_smtp(implicit=True)
    monkeypatch.setattr(email, "IMPLICIT_TLS_PORT", server.port)
    dispatcher = dispatcher_for(notifier(server.port, ca_file=ca_file), alert_store, clock)
    queue(alert_store, clock, group("firing"))
    assert dispatcher.deliver() == 1  # (this server speaks TLS alone: a delivery is one over TLS)
    assert [m.login for m in mailbox.messages] == [USER]
    assert dispatcher.failed == {"mail": 0}
    system_cas = notifier(server.port)  # not the test's CA: the handshake itself fails
    assert smtp.send(system_cas, "s", "t", "<p>h</p>", message_id="<a@b>", deadline=10).reason == (
        "TLS: certificate verify failed (unable to get local issuer certificate)"
    )


@pytest.mark.integration
def test_display_names_stay_in_the_header_and_the_envelope_has_the_bare_addresses(
    start_smtp: Start, mailbox: Mailbox, ca_file: str, alert_store: AlertStore, clock: Clock, frozen: FrozenClock,
) -> None:  # fmt: skip
    """An accented display name needs no SMTPUTF8 (this server does not offer it): the envelope has
    the bare address. A recipient refused for now is owed the message under the name `to` gives it."""
    server = start_smtp(smtputf8=False)
    mailbox.rcpt_replies = ["450 4.2.1 Mailbox busy, try again later"]  # the first recipient, once
    to = ["Équipe Ops <ops@example.com>", "On Call <oncall@example.com>"]
    dispatcher = dispatcher_for(notifier(server.port, ca_file=ca_file, to=to), alert_store, clock)
    queue(alert_store, clock, group("firing"))
    assert dispatcher.deliver() == 0  # one recipient still owed it
    frozen.advance(DUE_AGAIN)
    assert dispatcher.deliver() == 1
    assert [m.rcpt_tos for m in mailbox.messages] == [["oncall@example.com"], ["ops@example.com"]]
    assert {m.message["To"] for m in mailbox.messages} == {", ".join(to)}


def refusing(
    start_smtp: Start, mailbox: Mailbox, ca_file: str, alert_store: AlertStore, clock: Clock, address: str, reply: str
) -> tuple[Dispatcher, Controller]:
    """A dispatcher for `address`, whom the server answers `reply` at RCPT every time, and for
    oncall@example.com, who takes everything; one firing queued."""
    server = start_smtp()
    mailbox.refuse[address] = reply
    to = [address, "oncall@example.com"]
    dispatcher = dispatcher_for(notifier(server.port, ca_file=ca_file, to=to), alert_store, clock)
    queue(alert_store, clock, group("firing"))
    return dispatcher, server


FULL = "452 4.2.2 Mailbox full"


@pytest.mark.integration
def test_a_recipient_refused_for_good_is_logged_once_counted_and_never_tried_again(
    start_smtp: Start, mailbox: Mailbox, ca_file: str, alert_store: AlertStore, clock: Clock,
    frozen: FrozenClock, tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    caplog.set_level(logging.INFO, logger="exporter")
    gone = "550 5.1.1 No such mailbox"
    dispatcher, _ = refusing(start_smtp, mailbox, ca_file, alert_store, clock, "gone@example.com", gone)
    assert dispatcher.deliver() == 1
    frozen.advance(DUE_AGAIN)
    assert dispatcher.deliver() == 0
    assert [m.rcpt_tos for m in mailbox.messages] == [["oncall@example.com"]]
    ((_, _, delivered, reason),) = outbox(tmp_path)
    assert delivered is not None
    assert reason == ""
    queue(alert_store, clock, group("resolved"))  # the next one: refused again, not logged again
    assert dispatcher.deliver() == 1
    (refused,) = logged(caplog.records, "email recipient refused a notification for good; it is not sent to them again")
    assert refused.fields["recipient"] == "gone@example.com"  # type: ignore[attr-defined]
    assert refused.fields["reason"] == "SMTP 550"  # type: ignore[attr-defined]
    assert dispatcher.sent == {"mail": 2}
    assert dispatcher.failed == {"mail": 2}  # counted each time it refused


@pytest.mark.integration
def test_a_full_mailbox_holds_back_nothing_and_gets_each_message_once_it_has_room(
    start_smtp: Start, mailbox: Mailbox, ca_file: str, alert_store: AlertStore, clock: Clock,
    frozen: FrozenClock,
) -> None:  # fmt: skip
    dispatcher, _ = refusing(start_smtp, mailbox, ca_file, alert_store, clock, "full@example.com", FULL)
    other = group("firing")
    other["alerts"][0]["key"] = "another-alert"
    queue(alert_store, clock, other)
    for _ in range(3):  # the mailbox stays full: the queue goes on all the same
        dispatcher.deliver()
        frozen.advance(DUE_AGAIN)
    assert [m.rcpt_tos for m in mailbox.messages] == [["oncall@example.com"]] * 2
    del mailbox.refuse["full@example.com"]
    dispatcher.deliver()
    assert [m.rcpt_tos for m in mailbox.messages[2:]] == [["full@example.com"]] * 2
    ids = [m.message["Message-ID"] for m in mailbox.messages]
    assert ids[:2] == ids[2:]  # each message, once per recipient, under one Message-ID
    frozen.advance(DUE_AGAIN)
    dispatcher.deliver()
    assert len(mailbox.messages) == 4
    assert dispatcher.pending() == {}


@pytest.mark.integration
def test_a_recipient_owed_a_message_for_a_day_is_dropped_with_an_error(
    start_smtp: Start, mailbox: Mailbox, ca_file: str, alert_store: AlertStore, clock: Clock,
    frozen: FrozenClock, tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    caplog.set_level(logging.INFO, logger="exporter")
    dispatcher, _ = refusing(start_smtp, mailbox, ca_file, alert_store, clock, "full@example.com", FULL)
    dispatcher.deliver()
    frozen.advance(dt.timedelta(days=1, seconds=1))
    dispatcher.deliver()
    ((_, _, delivered, reason),) = outbox(tmp_path)
    assert delivered is not None
    assert reason == "the email recipients still owed it refused it for a day"
    (dropped,) = logged(caplog.records, "email recipients refused a notification for a day; it is dropped for them")
    assert dropped.fields["recipients"] == "full@example.com"  # type: ignore[attr-defined]
    assert len(mailbox.messages) == 1


@pytest.mark.integration
def test_a_server_without_starttls_gets_nothing_when_starttls_is_required(
    start_smtp: Start, mailbox: Mailbox, ca_file: str, alert_store: AlertStore, clock: Clock, tmp_path: Path
) -> None:
    server = start_smtp(tls=None)
    dispatcher = dispatcher_for(notifier(server.port, ca_file=ca_file), alert_store, clock)
    queue(alert_store, clock, group())
    assert dispatcher.deliver() == 0
    ((_, _, delivered, reason),) = outbox(tmp_path)
    assert delivered is None
    assert reason == "STARTTLS required but the server does not offer it (nothing was sent)"
    assert (mailbox.mails, mailbox.logins, mailbox.attempts) == ([], [], [])


@pytest.mark.integration
@pytest.mark.parametrize(
    ("names", "trusted"),
    [(("127.0.0.1",), False), (("smtp.example.com",), True)],
    ids=["unknown-ca", "another-name"],
)
def test_a_certificate_that_does_not_verify_fails_before_the_login(
    start_smtp: Start, mailbox: Mailbox, ca: trustme.CA, ca_file: str, alert_store: AlertStore, clock: Clock,
    tmp_path: Path, names: tuple[str, ...], trusted: bool,
) -> None:  # fmt: skip
    server = start_smtp(tls=server_tls(ca, *names))
    mail = notifier(server.port, ca_file=ca_file if trusted else None)  # untrusted: the system's CAs
    dispatcher = dispatcher_for(mail, alert_store, clock)
    queue(alert_store, clock, group())
    assert dispatcher.deliver() == 0
    ((_, _, _, reason),) = outbox(tmp_path)
    assert reason.startswith("TLS: certificate verify failed")
    assert (mailbox.mails, mailbox.logins, mailbox.attempts) == ([], [], [])


@pytest.mark.integration
def test_a_server_that_is_down_gets_the_message_once_when_it_comes_up(
    start_smtp: Start, mailbox: Mailbox, ca_file: str, alert_store: AlertStore, clock: Clock,
    frozen: FrozenClock, tmp_path: Path,
) -> None:  # fmt: skip
    port = free_port()
    dispatcher = dispatcher_for(notifier(port, ca_file=ca_file), alert_store, clock)
    queue(alert_store, clock, group())
    assert dispatcher.deliver() == 0
    ((_, _, _, reason),) = outbox(tmp_path)
    assert reason == "connection failed: connection refused"

    start_smtp(port=port)
    frozen.advance(DUE_AGAIN)
    dispatcher.start()  # the notifier's own worker delivers it
    try:
        wait_for(lambda: dispatcher.sent["mail"] == 1, timeout=30)
        dispatcher.poke()
        wait_for(lambda: not dispatcher.pending().get("mail"), timeout=30)
    finally:
        dispatcher.close()
        assert dispatcher.join(30)
    assert len(mailbox.messages) == 1
    assert dispatcher.deliver() == 0
    assert len(mailbox.messages) == 1


class StallingServer(LoopbackServer):
    """A scripted SMTP server on loopback that stalls in one `phase` of the exchange, sending a
    little every `interval` so that no read ever waits long: `greeting` (an endless multi-line
    greeting), `handshake` (it offers STARTTLS, then sends a TLS record announcing 16 KiB one
    byte at a time) or `data` (it takes the message, then answers with an endless multi-line 250),
    over TLS after STARTTLS when it has a `tls` context."""

    def __init__(self, phase: str, tls: ssl.SSLContext | None = None, interval: float = 0.2) -> None:
        super().__init__(backlog=4)
        self.phase = phase
        self.tls = tls
        self.interval = interval

    def _drip(self, connection: socket.socket, first: bytes, then: bytes) -> None:
        connection.sendall(first)
        while not self.stopping.wait(self.interval):
            connection.sendall(then)

    def serve(self, connection: socket.socket) -> None:
        with connection:
            try:
                if self.phase == "greeting":
                    self._drip(connection, b"220-stall.test\r\n", b"220-still here\r\n")
                    return
                connection.sendall(b"220 stall.test ESMTP\r\n")
                self._converse(connection)
            except OSError:
                return

    def _converse(self, connection: socket.socket) -> None:
        with connection.makefile("rb") as lines:
            for line in lines:
                command = line[:4].upper()
                if command in (b"EHLO", b"HELO"):
                    connection.sendall(b"250-stall.test\r\n250-STARTTLS\r\n250 8BITMIME\r\n")
                elif line[:8].upper() == b"STARTTLS":
                    connection.sendall(b"220 go ahead\r\n")
                    if self.phase == "handshake" or self.tls is None:
                        self._drip(connection, bytes([0x16, 0x03, 0x03, 0x40, 0x00]), b"\x00")
                        return
                    with self.tls.wrap_socket(connection, server_side=True) as secure:
                        self._converse(secure)
                    return
                elif command == b"DATA":
                    connection.sendall(b"354 go ahead\r\n")
                    for data in lines:
                        if data == b".\r\n":
                            break
                    self._drip(connection, b"250-almost\r\n", b"250-almost\r\n")
                    return
                elif command == b"QUIT":
                    connection.sendall(b"221 bye\r\n")
                    return
                else:
                    connection.sendall(b"250 OK\r\n")


@pytest.mark.integration
@pytest.mark.parametrize(
    ("phase", "starttls"), [("greeting", False), ("handshake", True), ("data", False), ("data", True)]
)
def test_a_server_that_stalls_holds_a_delivery_no_longer_than_the_deadline(
    phase: str, starttls: bool, ca: trustme.CA, ca_file: str, alert_store: AlertStore, clock: Clock, tmp_path: Path
) -> None:
    server = StallingServer(phase, server_tls(ca, "127.0.0.1"))
    mail = notifier(server.port, ca_file=ca_file, starttls=starttls, username=None, password=None)
    dispatcher = dispatcher_for(mail, alert_store, clock)
    dispatcher.deadline = 1.0
    queue(alert_store, clock, group())
    try:
        started = time.monotonic()
        assert dispatcher.deliver() == 0
        elapsed = time.monotonic() - started
    finally:
        server.stop()
    assert elapsed < 10  # 1 s, and a busy machine's slack; without the cut it would never end
    assert server.connections == 1
    ((_, attempts, delivered, reason),) = outbox(tmp_path)
    assert (attempts, delivered) == (1, None)  # kept, to be tried again
    assert reason == "deadline exceeded (no complete exchange within 1s)"


@pytest.mark.parametrize("queued_meanwhile", [False, True])
def test_an_email_owed_to_some_as_reloads_remove_its_notifier_and_add_it_back_is_dropped(
    outgoing: Outgoing, alert_store: AlertStore, clock: Clock, tmp_path: Path, queued_meanwhile: bool
) -> None:
    """While it is sent, reloads remove the notifier and add it back (whose queue starts empty);
    oncall takes it, ops is still owed it. With another notification queued meanwhile, the worker
    went on to that one, and the row owed to ops stayed in the queue of the notifier added back."""
    mail = notifier(1, to=["ops@example.com", "oncall@example.com"])
    dispatcher = dispatcher_for(mail, alert_store, clock)
    queue(alert_store, clock, group("firing"))
    sent = []

    def reloads_as_it_is_sent(*args: Any, **kwargs: Any) -> Sent:
        answer = outgoing(*args, **kwargs)
        sent.append(answer)
        if len(sent) == 1:
            dispatcher.configure([], "")
            dispatcher.configure([mail], "")
            if queued_meanwhile:
                queue(alert_store, clock, group("firing", endpoint_id="ep-other"))
            return Sent(None, {"ops@example.com": 450})
        return answer

    with pytest.MonkeyPatch.context() as patched:
        patched.setattr(smtp, "send", reloads_as_it_is_sent)
        dispatcher.deliver()
    first = outbox(tmp_path)[0]
    assert first[2] is not None  # (done with: dropped for the notifier that went)
    assert dispatcher.counts()[2]["notifier_removed"] == 1
