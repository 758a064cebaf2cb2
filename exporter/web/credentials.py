"""What the server serves with: its TLS context, who may see what basic auth guards, and the headers every response
carries. From the config's `server.tls` and `server.basic_auth`, or from a web configuration file in exporter-toolkit's
format (`--web.config.file`, read by `webconfig`), never from both: one of them would silently not apply."""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import ssl
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn, Protocol

import bcrypt

from exporter.config.schema import ServerConfig
from exporter.core.logs import get_logger
from exporter.web.webconfig import TlsServerConfig, WebConfig, WebConfigError, read_web_config

log = get_logger(__name__)


class TlsError(OSError):
    """The certificate or its key cannot be loaded. An OSError, as the ssl module's own errors are: at start-up
    it is reported as the server failing to come up."""


_TLS_REASONS = {"KEY_VALUES_MISMATCH": "the key is not the certificate's"}
"""OpenSSL's reasons, in words."""
BCRYPT_CACHE = 100
"""Passwords checked right remembered at once (exporter-toolkit keeps as many); wrong ones are remembered apart,
as many, so a flood of wrong passwords never pushes out a scrape's."""
BCRYPT_WAIT = 0.5
"""Seconds a request waits for its turn at bcrypt (one check runs at a time) before it is refused: under a flood
of wrong passwords a connection is answered at once rather than held, and the connection cap is not used up."""
BCRYPT_MAX_BYTES = 72
"""What bcrypt reads of a password: the rest is ignored, as htpasswd and Go ignore it (bcrypt 5 refuses longer
passwords instead; cut here, every version agrees)."""


def _no_passphrase() -> NoReturn:
    """Answers OpenSSL when a key is encrypted: its own default asks on the terminal, and the start-up or the reload
    would wait for an answer there."""
    raise TlsError("the key is encrypted; an unencrypted key is needed")


def _reason(error: OSError) -> str:
    if isinstance(error, ssl.SSLError):  # its "[SSL] PEM lib (_ssl.c:3905)" only says a file is not PEM
        return _TLS_REASONS.get(error.reason, error.reason) or "a file is not in PEM format"
    return error.strerror or str(error)


def _tls_context(cert_file: str, key_file: str, where: str) -> ssl.SSLContext:
    """A server context with this certificate and key, TLS 1.2 at least; TlsError naming `where` if they do not
    load (unreadable, not PEM, an encrypted key, or a key that is not the certificate's)."""
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        tls.load_cert_chain(cert_file, key_file, password=_no_passphrase)
    except (OSError, ValueError) as error:  # (ValueError: a path with a NUL in it)
        reason = _reason(error) if isinstance(error, OSError) else str(error)
        raise TlsError(
            f"{where}: cannot load the certificate {cert_file!r} with the key {key_file!r}: {reason}"
        ) from None
    return tls


class Password(Protocol):
    def check(self, username: str, password: str) -> bool:
        """Whether this user name and password may see what basic auth guards."""


@dataclass(frozen=True)
class PlainPassword:
    """`server.basic_auth`: one user, and the password itself (UTF-8); out of the repr, so that no log line or
    traceback can show it."""

    username: bytes
    password: bytes = field(repr=False)

    def check(self, username: str, password: str) -> bool:
        user_ok = hmac.compare_digest(username.encode(), self.username)
        return hmac.compare_digest(password.encode(), self.password) and user_ok


class BcryptUsers:
    """`basic_auth_users` of a web configuration file: each user's bcrypt hash.

    A bcrypt check costs tens of milliseconds by design. A scrape every few seconds must not pay it each time, so a
    password checked right is remembered, as exporter-toolkit does, under a keyed digest of the user, the hash and
    the password (never the password itself), BCRYPT_CACHE at most; wrong ones apart, so that they cannot push a
    right one out. One check runs at a time (a flood takes one core, not every one), and a request that cannot
    have its turn within BCRYPT_WAIT is refused: a remembered password never waits, and a flood holds no
    connection open. An unknown user's password is checked against the hash of the costliest user, so the time an
    answer takes does not tell which users exist.
    """

    def __init__(self, users: Mapping[str, bytes], before: BcryptUsers | None = None) -> None:
        """`before`: the users a reload replaces, whose remembered right passwords go on (each is of
        a user and a hash: one whose hash changed, or who is gone, matches none of them). Not the
        wrong ones: an unknown user's was checked against another's hash, and the reload may add
        that user with it."""
        self._users = dict(users)
        self._decoy = max(self._users.values(), key=lambda hashed: int(hashed.split(b"$")[2]), default=b"")
        self._key: bytes = os.urandom(32) if before is None else before._key
        self._right: dict[bytes, None] = {} if before is None else dict(before._right)
        self._wrong: dict[bytes, None] = {}
        self._known_lock = threading.Lock()
        self._bcrypt_lock = threading.Lock()
        self._refused: set[str] = set()
        """Users whose hash bcrypt refused (logged once each)."""

    def __repr__(self) -> str:
        return f"BcryptUsers({len(self._users)} users)"

    def _digest(self, *parts: bytes) -> bytes:
        mac = hmac.new(self._key, digestmod=hashlib.sha256)
        for part in parts:  # each with its length: ("ab", "c") and ("a", "bc") differ
            mac.update(len(part).to_bytes(8, "big") + part)
        return mac.digest()

    def _remember(self, outcomes: dict[bytes, None], key: bytes) -> None:
        with self._known_lock:
            if len(outcomes) >= BCRYPT_CACHE:
                del outcomes[next(iter(outcomes))]  # the oldest
            outcomes[key] = None

    def _known(self, key: bytes, known_user: bool) -> bool | None:
        """Whether the password of `key` was found right or wrong before; None if it was not checked.
        (Right only for a user there is: one a reload removed may have had the decoy's hash.)"""
        with self._known_lock:
            if key in self._right:
                return known_user
            if key in self._wrong:
                return False
        return None

    def check(self, username: str, password: str) -> bool:
        hashed = self._users.get(username)
        known_user = hashed is not None
        hashed = hashed if hashed is not None else self._decoy
        secret = password.encode()[:BCRYPT_MAX_BYTES]
        key = self._digest(username.encode(), hashed, secret)
        known = self._known(key, known_user)
        if known is not None:
            return known
        if not hashed or not self._bcrypt_lock.acquire(timeout=BCRYPT_WAIT):
            return False  # no users, or bcrypt busy with others: refused now, asked again by the next request
        try:  # (for an unknown user too, against the decoy: the same time either way)
            known = self._known(key, known_user)  # (checked by a request it waited behind: the same password)
            if known is not None:
                return known
            matched = bcrypt.checkpw(secret, hashed)
        except ValueError:  # a hash of the right shape that bcrypt refuses (its salt mistyped): nothing matches it
            matched = False
            if known_user and username not in self._refused:
                self._refused.add(username)
                log.error("a basic_auth_users hash is not one bcrypt can check: its user cannot log in", user=username)
        finally:
            self._bcrypt_lock.release()
        right = known_user and matched
        self._remember(self._right if right else self._wrong, key)
        return right


@dataclass(frozen=True)
class Credentials:
    """What the server serves new connections and requests with; replaced whole on a reload, so a request sees
    one certificate and one password, never half of a change."""

    tls: ssl.SSLContext | None
    auth: Password | None = field(default=None, repr=False)
    headers: tuple[tuple[str, str], ...] = ()
    """Added to every response (`http_server_config.headers`)."""

    @classmethod
    def load(
        cls, config: ServerConfig, web_config: str | Path | None = None, before: Credentials | None = None
    ) -> Credentials:
        """From `server.tls` and `server.basic_auth`, or from the web configuration file `web_config`
        (WebConfigError when it is bad, or when the config sets either key too). The files are read now: a renewed
        certificate often keeps its paths, so they are read again on each reload, not only when the config names
        other files. `before`: the credentials a reload replaces (the passwords they remember go on)."""
        if web_config is not None:
            users = before.auth if before is not None and isinstance(before.auth, BcryptUsers) else None
            return cls._from_web_config(config, web_config, users)
        tls = None
        if config.tls is not None:
            tls = _tls_context(config.tls.cert_file, config.tls.key_file, "server.tls")
        auth = None
        if config.basic_auth is not None:
            password = config.basic_auth.password.get_secret_value().encode()
            auth = PlainPassword(config.basic_auth.username.encode(), password)
        return cls(tls, auth)

    @classmethod
    def _from_web_config(cls, config: ServerConfig, path: str | Path, before: BcryptUsers | None) -> Credentials:
        also = [name for name, value in (("server.tls", config.tls), ("server.basic_auth", config.basic_auth)) if value]
        if also:
            raise WebConfigError(path, [
                f"the config's {' and '.join(also)} would secure the server too; use this file or those keys, "
                "not both"
            ])  # fmt: skip
        web = read_web_config(path)
        for note in web.notes:
            log.info("web config: accepted without effect", path=str(path), detail=note)
        tls = None if web.tls is None else _web_tls(web, web.tls)
        return cls(tls, BcryptUsers(web.users, before) if web.users else None, web.headers)

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
        return self.auth.check(username, password)


def _web_tls(web: WebConfig, tls: TlsServerConfig) -> ssl.SSLContext:
    """The server's TLS context from `tls_server_config`; WebConfigError naming the file and the field."""
    try:
        context = _tls_context(tls.cert_file, tls.key_file, "tls_server_config")
    except TlsError as error:
        raise WebConfigError(web.path, [str(error)]) from None
    context.minimum_version, context.maximum_version = tls.min_version, tls.max_version
    if tls.ciphers is not None:
        try:
            context.set_ciphers(tls.ciphers)
        except ssl.SSLError:
            raise WebConfigError(
                web.path, ["tls_server_config.cipher_suites: OpenSSL here offers none of them"]
            ) from None
    if not tls.prefer_server_cipher_suites:
        context.options &= ~ssl.OP_CIPHER_SERVER_PREFERENCE
    context.verify_mode = tls.client_auth
    if tls.client_ca_file is not None or tls.client_ca is not None:
        where = "client_ca_file" if tls.client_ca_file is not None else "client_ca"
        try:
            context.load_verify_locations(cafile=tls.client_ca_file, cadata=tls.client_ca)
        except (OSError, ValueError) as error:
            named = f" {tls.client_ca_file!r}" if tls.client_ca_file is not None else ""
            reason = _reason(error) if isinstance(error, OSError) else str(error)
            raise WebConfigError(web.path, [f"tls_server_config.{where}: cannot load{named}: {reason}"]) from None
    return context
