"""What the server serves with: its TLS certificate and key, and the basic-auth user and password; loaded from
the config, and checked against a request's Authorization header."""

from __future__ import annotations

import base64
import hmac
import ssl
from dataclasses import dataclass, field
from typing import NoReturn

from exporter.config.schema import ServerConfig


class TlsError(OSError):
    """The certificate or its key cannot be loaded. An OSError, as the ssl module's own errors are: at start-up
    it is reported as the server failing to come up."""


_TLS_REASONS = {"KEY_VALUES_MISMATCH": "the key is not the certificate's"}
"""OpenSSL's reasons, in words."""


def _no_passphrase() -> NoReturn:
    """Answers OpenSSL when a key is encrypted: its own default asks on the terminal, and the start-up or the reload
    would wait for an answer there."""
    raise TlsError("the key is encrypted; an unencrypted key is needed")


@dataclass(frozen=True)
class Credentials:
    """What the server serves new connections and requests with; replaced whole on a reload, so a request sees
    one certificate and one password, never half of a change."""

    tls: ssl.SSLContext | None
    auth: tuple[bytes, bytes] | None = field(default=None, repr=False)
    """The basic-auth user and password, UTF-8; out of the repr, so that no log line or traceback can show them."""

    @classmethod
    def load(cls, config: ServerConfig) -> Credentials:
        """Read the certificate and key files now: a renewed certificate often keeps its paths, so they are read
        again on each reload, not only when the config names other files."""
        tls = None
        if config.tls is not None:
            tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            tls.minimum_version = ssl.TLSVersion.TLSv1_2
            try:
                tls.load_cert_chain(config.tls.cert_file, config.tls.key_file, password=_no_passphrase)
            except OSError as error:  # unreadable, not PEM, encrypted, or a key that is not the certificate's
                if isinstance(error, ssl.SSLError):  # its "[SSL] PEM lib (_ssl.c:3905)" only says a file is not PEM
                    detail = _TLS_REASONS.get(error.reason, error.reason) or "a file is not in PEM format"
                else:
                    detail = error.strerror or str(error)
                raise TlsError(
                    f"server.tls: cannot load the certificate {config.tls.cert_file!r} with the key "
                    f"{config.tls.key_file!r}: {detail}"
                ) from None
        auth = None
        if config.basic_auth is not None:
            auth = (config.basic_auth.username.encode(), config.basic_auth.password.get_secret_value().encode())
        return cls(tls, auth)

    def authorised(self, authorization: str) -> bool:
        """Whether a request with this Authorization header (empty: none) may see what basic auth guards."""
        if self.auth is None:
            return True
        scheme, _, encoded = authorization.partition(" ")
        if scheme.lower() != "basic":
            return False
        try:
            username, _, password = base64.b64decode(encoded, validate=True).decode("utf-8").partition(":")
        except (ValueError, UnicodeDecodeError):
            return False
        expected_user, expected_password = self.auth
        user_ok = hmac.compare_digest(username.encode(), expected_user)
        return hmac.compare_digest(password.encode(), expected_password) and user_ok
