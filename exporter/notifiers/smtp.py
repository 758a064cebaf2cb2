"""Sending one email over SMTP under one deadline (the `email` kind's transport).

`send` makes one SMTP exchange (connect, EHLO, STARTTLS with the server's certificate verified,
or TLS from the start on port 465, login, the message, QUIT) under one `Deadline`, which shuts
the connection down when it passes, whatever the exchange is waiting for (the greeting, a reply,
the TLS handshake), since a socket's timeout bounds each read, not a server that answers one line
every few seconds; the server's name, and this machine's for EHLO, are looked up within the time
left too (`core.lookup`). It never raises for a network, TLS or SMTP fault: it returns a short reason,
which names no credential and nothing of the message. A reason that starts with `SMTP 5` is the
server refusing this message (its sender, its recipients or its content) for good; every other
one (4xx, a refused login, a missing STARTTLS, a certificate, the network, the deadline) is worth
retrying.
"""

from __future__ import annotations

import smtplib
import socket
import ssl
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from email.message import EmailMessage
from email.utils import formatdate, parseaddr
from typing import TYPE_CHECKING

from exporter.core import lookup
from exporter.core.deadline import Deadline
from exporter.core.net import network_cause
from exporter.core.words import line

if TYPE_CHECKING:
    from exporter.notifiers.email import EmailNotifier


def _encodable(text: str) -> str:
    """Text UTF-8 can carry: a lone surrogate (JSON lets an API send one) becomes "?", so one odd
    name cannot make a message that fails for ever."""
    return text.encode("utf-8", "replace").decode("utf-8")


def build(notifier: EmailNotifier, subject: str, text: str, html_body: str, message_id: str) -> EmailMessage:
    """multipart/alternative: the plain text, then the HTML."""
    message = EmailMessage()
    message["From"] = notifier.from_
    message["To"] = ", ".join(notifier.to)
    message["Subject"] = line(_encodable(subject))
    message["Date"] = formatdate(usegmt=True)
    message["Message-ID"] = message_id
    # Quoted-printable: 7-bit lines whatever the labels hold, for a server without 8BITMIME too.
    message.set_content(_encodable(text), cte="quoted-printable")
    message.add_alternative(_encodable(html_body), subtype="html", cte="quoted-printable")
    return message


EHLO_NAME_WAIT = 1.0
"""The longest an exchange waits for this machine's name to give in EHLO (`_local_hostname`)."""


def _local_hostname(timer: Deadline) -> str:
    """The name given in EHLO: this machine's fully qualified name (a reverse lookup, made once),
    waited for at most EHLO_NAME_WAIT, and a quarter of the exchange's time left (the rest is the
    exchange's); till that lookup ends, the host name as it is set (no lookup)."""
    try:
        return lookup.fqdn(lookup.within(min(EHLO_NAME_WAIT, timer.remaining() / 4)))
    except lookup.LookupTimeout:
        return socket.gethostname()


def _context(notifier: EmailNotifier) -> ssl.SSLContext:
    """Verifies the server's certificate and name, against `ca_file` or the system's CAs."""
    try:
        return ssl.create_default_context(cafile=notifier.ca_file)
    except (OSError, ValueError) as error:
        raise _Failed(f"TLS: cannot load ca_file ({type(error).__name__})") from None


class _Client(smtplib.SMTP):
    """smtplib's client (it connects and reads the greeting as it is made), its connection
    watched by the deadline as soon as there is one; with `tls`, TLS from the first byte (the
    handshake done once the TLS socket is watched, so the deadline can cut it)."""

    def __init__(self, timer: Deadline, host: str, port: int, timeout: float, tls: ssl.SSLContext | None) -> None:
        self._timer = timer
        self._tls = tls
        super().__init__(host, port, local_hostname=_local_hostname(timer), timeout=timeout)

    def _get_socket(self, host: str, port: int, timeout: float) -> socket.socket:
        connected = lookup.create_connection(
            (host, port), timeout, self.source_address, time_left=self._timer.remaining
        )
        plain = self._timer.watch(connected)
        if self._tls is None:
            return plain
        tls = self._timer.watch(self._tls.wrap_socket(plain, server_hostname=host, do_handshake_on_connect=False))
        tls.do_handshake()
        return tls


class _Failed(Exception):
    """A step of the exchange failed for a reason already put in words."""


def _exchange(
    smtp: smtplib.SMTP,
    notifier: EmailNotifier,
    message: EmailMessage,
    timer: Deadline,
    recipients: Sequence[str],
) -> dict[str, int]:
    """The exchange; the recipients the server refused while it took the message for others, with
    the SMTP code of each."""
    smtp.ehlo_or_helo_if_needed()
    if notifier.starttls and not notifier.implicit_tls:
        if not smtp.has_extn("starttls"):
            raise _Failed("STARTTLS required but the server does not offer it (nothing was sent)")
        context = _context(notifier)
        if smtp.sock is not None:
            # The handshake cannot be cut (the plain socket is handed over to TLS before it starts),
            # but a TLS socket's timeout bounds the whole handshake, not each read: the time left.
            smtp.sock.settimeout(max(0.001, timer.remaining()))
        try:
            smtp.starttls(context=context)
        except smtplib.SMTPResponseException as error:
            raise _Failed(f"STARTTLS refused (SMTP {error.smtp_code})") from None
        if smtp.sock is not None:
            timer.watch(smtp.sock)
        smtp.ehlo_or_helo_if_needed()  # again: what the server said before TLS no longer counts
    if notifier.username is not None and notifier.password is not None:
        try:
            smtp.login(notifier.username, notifier.password.get_secret_value())
        except smtplib.SMTPAuthenticationError as error:
            raise _Failed(f"login refused (SMTP {error.smtp_code})") from None
        except smtplib.SMTPNotSupportedError:
            raise _Failed("login impossible: the server offers no AUTH") from None
        except UnicodeError:
            raise _Failed("login impossible: the username or password is not ASCII") from None
        except smtplib.SMTPException as error:
            if type(error) is not smtplib.SMTPException:  # a disconnection, an EHLO refused: told below
                raise
            raise _Failed("login impossible: the server offers no AUTH method smtplib supports") from None
    # The envelope has the bare addresses: a display name (`Équipe Ops <ops@example.com>`) belongs in
    # the To: header, and in the envelope would ask for SMTPUTF8, which many relays do not offer.
    envelope = {parseaddr(recipient)[1]: recipient for recipient in recipients}
    try:
        # A partial refusal returns: the others have the message, so it must not be sent to them again.
        refused = smtp.send_message(message, to_addrs=list(envelope))
    except smtplib.SMTPRecipientsRefused as error:
        codes = sorted(code for code, _ in error.recipients.values())
        transient = [code for code in codes if not 500 <= code < 600]
        raise _Failed(f"SMTP {(transient or codes or [0])[0]} (recipient refused)") from None
    except smtplib.SMTPSenderRefused as error:
        if error.smtp_code == 530:  # the server wants a login the config does not give: not this message's fault
            raise _Failed("login required (SMTP 530)") from None
        raise _Failed(f"SMTP {error.smtp_code} (sender refused)") from None
    except smtplib.SMTPDataError as error:
        raise _Failed(f"SMTP {error.smtp_code} (message refused)") from None
    except smtplib.SMTPNotSupportedError:
        raise _Failed("the server cannot take non-ASCII addresses (no SMTPUTF8)") from None
    with suppress(OSError, smtplib.SMTPException):  # the message is in: a failed goodbye changes nothing
        smtp.quit()
    return {envelope.get(address, address): code for address, (code, _) in refused.items()}


def _reason(error: Exception) -> str:
    """A failure in words; never the server's own text (it may echo an address or the login)."""
    if isinstance(error, _Failed):
        return str(error)
    if isinstance(error, ssl.SSLCertVerificationError):
        detail = error.verify_message or ""
        return f"TLS: certificate verify failed ({detail})" if detail else "TLS: certificate verify failed"
    if isinstance(error, ssl.SSLError):
        return f"TLS: {error.reason or 'handshake failed'}"
    if isinstance(error, smtplib.SMTPServerDisconnected):
        return "connection failed: the server closed the connection"
    if isinstance(error, smtplib.SMTPConnectError):
        return f"the server refused the connection (SMTP {error.smtp_code})"
    if isinstance(error, smtplib.SMTPHeloError):
        return f"EHLO refused (SMTP {error.smtp_code})"
    if isinstance(error, smtplib.SMTPResponseException):
        return f"unexpected answer (SMTP {error.smtp_code})"
    if isinstance(error, OSError):
        return f"connection failed: {network_cause(error)}"
    return f"SMTP exchange failed ({type(error).__name__})"


@dataclass(frozen=True)
class Sent:
    """What became of one message: `reason` None once the server took it (see the module's
    docstring); `refused`, the recipients it refused meanwhile (address: SMTP code): a 4xx is
    worth sending to that recipient again, a 5xx is not."""

    reason: str | None
    refused: dict[str, int] = field(default_factory=dict)


def send(
    notifier: EmailNotifier,
    subject: str,
    text: str,
    html: str,
    *,
    message_id: str,
    deadline: float,
    recipients: Sequence[str] = (),
) -> Sent:
    """Send one message to `recipients` (all of `notifier.to` when empty; the To: header names them
    all either way). The whole exchange ends within about `deadline` seconds."""
    timer = Deadline(deadline)
    smtp = None
    try:
        message = build(notifier, subject, text, html, message_id)
        tls = _context(notifier) if notifier.implicit_tls else None
        smtp = _Client(timer, notifier.host, notifier.port, deadline, tls)
        refused = _exchange(smtp, notifier, message, timer, recipients or notifier.to)
    except (_Failed, OSError, smtplib.SMTPException, ValueError) as error:
        if timer.passed:  # cut, or a timeout set to the time left (the handshake's)
            return Sent(f"deadline exceeded (no complete exchange within {deadline:g}s)")
        return Sent(_reason(error))
    finally:
        timer.close()  # no cut after this, then every socket of the exchange closed (in that order)
        if smtp is not None:
            smtp.close()  # its reader too, which holds the socket open
    return Sent(None, refused)
