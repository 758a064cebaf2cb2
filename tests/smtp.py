"""A real SMTP server in-process (aiosmtpd) with STARTTLS by a test CA (trustme) and one login:
fixtures for the email notifier's tests and the digest's."""

from __future__ import annotations

import ssl
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from email import policy
from email.message import EmailMessage
from email.parser import BytesParser
from typing import Any

import pytest
import trustme
from aiosmtpd.controller import Controller
from aiosmtpd.smtp import AuthResult, LoginPassword

from tests.helpers import free_port

USER = "alerts-user"
PASSWORD = "pa55-W0rd-never-logged"
FROM = "Cost exporter <exporter@example.com>"
TO = ["ops@example.com", "oncall@example.com"]


@dataclass
class Received:
    message: EmailMessage
    mail_from: str
    rcpt_tos: list[str]
    tls: bool
    login: str | None


class Mailbox:
    """An aiosmtpd handler and authenticator: keeps what the server saw; `rcpt_replies` and
    `data_replies` are answered (in order) instead of accepting a recipient or a message."""

    def __init__(self) -> None:
        self.messages: list[Received] = []
        self.attempts: list[EmailMessage] = []
        """Every message whose data arrived, taken or not."""
        self.mails: list[bool] = []
        """Each MAIL command, and whether it came over TLS."""
        self.logins: list[bool] = []
        self.rcpt_replies: list[str] = []
        self.refuse: dict[str, str] = {}
        """Recipients answered this reply at RCPT, every time, instead of being accepted."""
        self.data_replies: list[str] = []
        self.names: list[str] = []
        """The name each message taken was sent from (the client's EHLO)."""

    async def handle_MAIL(self, server: Any, session: Any, envelope: Any, address: str, options: list[str]) -> str:  # noqa: N802
        self.mails.append(session.ssl is not None)
        envelope.mail_from = address
        envelope.mail_options.extend(options)
        return "250 OK"

    async def handle_RCPT(self, server: Any, session: Any, envelope: Any, address: str, options: list[str]) -> str:  # noqa: N802
        if self.rcpt_replies:
            return self.rcpt_replies.pop(0)
        if address in self.refuse:
            return self.refuse[address]
        envelope.rcpt_tos.append(address)
        return "250 OK"

    async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:  # noqa: N802
        message = BytesParser(policy=policy.default).parsebytes(envelope.content)
        assert isinstance(message, EmailMessage)
        self.attempts.append(message)
        if self.data_replies:
            return self.data_replies.pop(0)
        login = session.auth_data.login.decode() if session.authenticated else None
        self.messages.append(
            Received(message, envelope.mail_from, list(envelope.rcpt_tos), session.ssl is not None, login)
        )
        self.names.append(session.host_name)
        return "250 OK"

    def authenticate(self, server: Any, session: Any, envelope: Any, mechanism: str, data: Any) -> AuthResult:
        ok = isinstance(data, LoginPassword) and (data.login, data.password) == (USER.encode(), PASSWORD.encode())
        self.logins.append(ok)
        return AuthResult(success=ok, auth_data=data if ok else None, handled=False)


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture(scope="module")
def ca_file(ca: trustme.CA, tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("ca") / "ca.pem"
    ca.cert_pem.write_to_path(str(path))
    return str(path)


def server_tls(ca: trustme.CA, *names: str) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert(*names).configure_cert(context)
    return context


@pytest.fixture
def mailbox() -> Mailbox:
    return Mailbox()


Start = Callable[..., Controller]


@pytest.fixture
def start_smtp(ca: trustme.CA, mailbox: Mailbox) -> Iterator[Start]:
    """Starts an SMTP server on 127.0.0.1 (on `port`, or a free one) that requires STARTTLS (with a
    certificate for 127.0.0.1 by the test CA, unless `tls` says otherwise: None for no TLS at all)
    and accepts one login, only over TLS; offers SMTPUTF8 unless `smtputf8` is False (as many relays
    do not); with `implicit`, speaks TLS from the first byte instead of STARTTLS (SMTPS, as on port
    465); stops them all afterwards."""
    started: list[Controller] = []
    default_tls = server_tls(ca, "127.0.0.1")

    def start(
        port: int | None = None, tls: ssl.SSLContext | str | None = "default", smtputf8: bool = True,
        implicit: bool = False,
    ) -> Controller:  # fmt: skip
        context = default_tls if tls == "default" else tls
        assert not isinstance(context, str)
        starttls = None if implicit else context
        controller = Controller(
            mailbox, hostname="127.0.0.1", port=port or free_port(), server_hostname="smtp.test",
            ready_timeout=30, tls_context=starttls, require_starttls=starttls is not None,
            ssl_context=context if implicit else None,
            auth_require_tls=not implicit, authenticator=mailbox.authenticate, enable_SMTPUTF8=smtputf8,
        )  # fmt: skip
        controller.start()
        started.append(controller)
        return controller

    yield start
    for controller in started:
        controller.stop()
