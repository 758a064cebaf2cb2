"""The web configuration file the Prometheus exporters share (exporter-toolkit's format, `--web.config.file`): its
`tls_server_config`, `http_server_config` and `basic_auth_users`, read into a `WebConfig`.

Every problem in the file is reported at once, each as `FILE: field: problem`. What Python's TLS cannot do as Go's
does is refused by name rather than ignored: a key that secures the server must never be dropped silently. Two keys
are accepted without effect: `http_server_config.http2` (this server speaks HTTP/1.1, which Prometheus scrapes) and
`tls_server_config.curve_preferences` (OpenSSL's default groups apply; `notes` says so, for the log).
"""

from __future__ import annotations

import re
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from exporter.config.load import parse_yaml, yaml_problem

TLS_VERSIONS = {
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}
OLD_TLS = frozenset({"TLS10", "TLS11"})
"""exporter-toolkit's names for versions OpenSSL no longer negotiates at its default security level: a file
that asks for them would start cleanly and then fail every handshake, so it is refused."""
BCRYPT_COST_WARNING = 12
"""Above this cost one check takes a quarter of a second or more; each user's first scrape (and every wrong
password) pays it."""
CLIENT_AUTH = {
    "NoClientCert": ssl.CERT_NONE,
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
}
"""Go's client auth types that OpenSSL can do: it verifies every certificate a client sends."""
UNVERIFIED_CLIENT_AUTH = frozenset({"RequestClientCert", "RequireAnyClientCert", "RequireClientCert"})
"""Go's types that take a client's certificate without verifying it: no protection, and not something OpenSSL does."""
CIPHER_SUITES = {
    "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256": "ECDHE-ECDSA-AES128-GCM-SHA256",
    "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384": "ECDHE-ECDSA-AES256-GCM-SHA384",
    "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256": "ECDHE-RSA-AES128-GCM-SHA256",
    "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384": "ECDHE-RSA-AES256-GCM-SHA384",
    "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-ECDSA-CHACHA20-POLY1305",
    "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-RSA-CHACHA20-POLY1305",
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA": "ECDHE-ECDSA-AES128-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_256_CBC_SHA": "ECDHE-ECDSA-AES256-SHA",
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA": "ECDHE-RSA-AES128-SHA",
    "TLS_ECDHE_RSA_WITH_AES_256_CBC_SHA": "ECDHE-RSA-AES256-SHA",
    "TLS_RSA_WITH_AES_128_GCM_SHA256": "AES128-GCM-SHA256",
    "TLS_RSA_WITH_AES_256_GCM_SHA384": "AES256-GCM-SHA384",
    "TLS_RSA_WITH_AES_128_CBC_SHA": "AES128-SHA",
    "TLS_RSA_WITH_AES_256_CBC_SHA": "AES256-SHA",
}
"""Go's names of the TLS 1.2 suites Go offers (tls.CipherSuites), with OpenSSL's."""
TLS13_SUITES = frozenset({"TLS_AES_128_GCM_SHA256", "TLS_AES_256_GCM_SHA384", "TLS_CHACHA20_POLY1305_SHA256"})
"""Accepted in `cipher_suites` and without effect, as in Go: TLS 1.3's suites are not configurable."""
CURVES = frozenset({"CurveP256", "CurveP384", "CurveP521", "X25519"})
HEADERS: dict[str, tuple[str, ...]] = {
    "Strict-Transport-Security": (),
    "X-Content-Type-Options": ("nosniff",),
    "X-Frame-Options": ("deny", "sameorigin"),
    "X-XSS-Protection": (),
    "Content-Security-Policy": (),
}
"""The response headers the file may set, with their allowed values (any when none are listed), as exporter-toolkit
allows them."""
BCRYPT_HASH = re.compile(r"\$2[aby]\$(\d\d)\$[./A-Za-z0-9]{53}")
HOW_TO_HASH = "make one with `htpasswd -nBC 10 \"\" | tr -d ':\\n'`"

_TOP = ("tls_server_config", "http_server_config", "basic_auth_users")
_TLS_KEYS = (
    "cert_file", "key_file", "client_auth_type", "client_ca_file", "client_ca", "min_version", "max_version",
    "cipher_suites", "prefer_server_cipher_suites", "curve_preferences",
)  # fmt: skip
_HTTP_KEYS = ("http2", "headers")
_UNSUPPORTED = {
    "tls_server_config.cert": "an inline certificate is not supported here; put it in a file for cert_file",
    "tls_server_config.key": "an inline key is not supported here; put it in a file for key_file",
    "tls_server_config.client_allowed_sans": "not supported by this exporter; issue client certificates from a CA "
    "of their own (client_ca_file) instead",
    "rate_limit": "not supported by this exporter",
}
"""Keys of the format this exporter refuses rather than ignore: each would secure or limit the server."""
_ENABLES_TLS = ("cert_file", "key_file", "client_ca_file", "client_ca", "client_auth_type")
"""Any of these turns TLS on (as exporter-toolkit's TLSConfig.IsEnabled, less what is refused); without any of them,
a `tls_server_config` with only versions or suites leaves the server on plain HTTP, as there."""


class WebConfigError(Exception):
    """Every problem in a web configuration file, each as `FILE: field: problem` (`details`)."""

    def __init__(self, path: str | Path, problems: list[str]) -> None:
        self.details = [f"{path}: {problem}" for problem in problems]
        super().__init__("; ".join(self.details))


@dataclass(frozen=True)
class TlsServerConfig:
    cert_file: str
    key_file: str
    client_auth_type: str
    client_auth: ssl.VerifyMode
    client_ca_file: str | None
    client_ca: str | None
    """The client CA certificates written in the file itself (PEM)."""
    min_version: ssl.TLSVersion
    max_version: ssl.TLSVersion
    ciphers: str | None
    """OpenSSL's cipher list for TLS 1.2 and below; None: OpenSSL's defaults."""
    prefer_server_cipher_suites: bool


@dataclass(frozen=True)
class WebConfig:
    path: str
    tls: TlsServerConfig | None
    headers: tuple[tuple[str, str], ...] = ()
    users: Mapping[str, bytes] = field(default_factory=dict, repr=False)
    """User name → bcrypt hash."""
    notes: tuple[str, ...] = ()
    """Keys accepted without effect here, in words, for the log."""


def read_web_config(path: str | Path) -> WebConfig:
    """Read and check the file; WebConfigError with every problem found."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as error:
        raise WebConfigError(path, [f"cannot read ({error.strerror or error})"]) from None
    except UnicodeDecodeError as error:
        raise WebConfigError(path, [f"not UTF-8 text (byte {error.start + 1} cannot be read)"]) from None
    try:
        raw = parse_yaml(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise WebConfigError(path, [f"{where}invalid YAML: {yaml_problem(error)}"]) from None
    reader = _Reader(Path(path))
    config = reader.read({} if raw is None else raw)
    if reader.problems:
        raise WebConfigError(path, reader.problems)
    return config


class _Reader:
    """Reads the document, noting each problem with its field and going on, so that all are reported at once."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.problems: list[str] = []
        self.notes: list[str] = []

    def problem(self, where: str, text: str) -> None:
        self.problems.append(f"{where}: {text}")

    def dictionary(self, node: object, where: str, what: str = "not a mapping") -> dict[Any, Any]:
        """`node`, a mapping; {} when absent, or when it is something else (noted as `what`)."""
        if node is None:
            return {}
        if not isinstance(node, dict):
            self.problem(where, what)
            return {}
        return node

    def mapping(self, node: object, where: str, keys: tuple[str, ...]) -> dict[str, Any]:
        """`node` as a mapping of the known `keys` (each unknown or refused one noted); {} when it is none."""
        taken = {}
        for key, value in self.dictionary(node, where).items():
            name = f"{where}.{key}" if where != "(top level)" else str(key)
            if name in _UNSUPPORTED:
                self.problem(name, _UNSUPPORTED[name])
            elif key not in keys:
                self.problem(name, f"unknown key (expected one of {', '.join(keys)})")
            else:
                taken[key] = value
        return taken

    def string(self, node: dict[str, Any], key: str, where: str) -> str | None:
        value = node.get(key)
        if value is None or value == "":
            return None
        if not isinstance(value, str):
            self.problem(f"{where}.{key}", "not a string")
            return None
        return value

    def boolean(self, node: dict[str, Any], key: str, where: str, default: bool) -> bool:
        value = node.get(key, default)
        if not isinstance(value, bool):
            self.problem(f"{where}.{key}", "not true or false")
            return default
        return value

    def strings(self, node: dict[str, Any], key: str, where: str) -> list[str]:
        value = node.get(key)
        if value is None:
            return []
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            self.problem(f"{where}.{key}", "not a list of strings")
            return []
        return value

    def file(self, name: str | None) -> str | None:
        """A path as given, relative ones taken from the web config file's directory (as exporter-toolkit does)."""
        return None if name is None else str(self.path.parent / name)

    def read(self, raw: object) -> WebConfig:
        if not isinstance(raw, dict):
            self.problem("(top level)", "the web configuration must be a mapping")
            return WebConfig(str(self.path), None)
        top = self.mapping(raw, "(top level)", _TOP)
        tls = self.tls(self.mapping(top.get("tls_server_config"), "tls_server_config", _TLS_KEYS))
        http = self.mapping(top.get("http_server_config"), "http_server_config", _HTTP_KEYS)
        self.boolean(http, "http2", "http_server_config", True)  # (checked; this server speaks HTTP/1.1 either way)
        headers = self.headers(http.get("headers"))
        users = self.users(top.get("basic_auth_users"))
        return WebConfig(str(self.path), tls, headers, users, tuple(self.notes))

    def tls(self, node: dict[str, Any]) -> TlsServerConfig | None:
        """`tls_server_config`: None when it turns TLS off, or when it is bad (the problems noted)."""
        where = "tls_server_config"
        versions = {
            key: self.version(node, key, default)
            for key, default in (("min_version", ssl.TLSVersion.TLSv1_2), ("max_version", ssl.TLSVersion.TLSv1_3))
        }
        if versions["min_version"] > versions["max_version"]:
            self.problem(where, "min_version is above max_version")
        ciphers = self.ciphers(self.strings(node, "cipher_suites", where))
        prefer = self.boolean(node, "prefer_server_cipher_suites", where, True)
        self.curves(self.strings(node, "curve_preferences", where))
        cert, key = self.string(node, "cert_file", where), self.string(node, "key_file", where)
        client_ca_file, client_ca = self.string(node, "client_ca_file", where), self.string(node, "client_ca", where)
        if not any(node.get(key) not in (None, "") for key in _ENABLES_TLS):
            return None
        for name, value in (("cert_file", cert), ("key_file", key)):
            if value is None:
                self.problem(f"{where}.{name}", "required when TLS is on")
        if client_ca_file is not None and client_ca is not None:
            self.problem(where, "client_ca_file and client_ca both given; keep one")
        auth_type = self.client_auth(node, has_ca=client_ca_file is not None or client_ca is not None)
        if cert is None or key is None or auth_type is None:
            return None
        return TlsServerConfig(
            cert_file=str(self.file(cert)), key_file=str(self.file(key)), client_auth_type=auth_type,
            client_auth=CLIENT_AUTH[auth_type], client_ca_file=self.file(client_ca_file), client_ca=client_ca,
            min_version=versions["min_version"], max_version=versions["max_version"], ciphers=ciphers,
            prefer_server_cipher_suites=prefer,
        )  # fmt: skip

    def client_auth(self, node: dict[str, Any], *, has_ca: bool) -> str | None:
        """`client_auth_type`, checked against the client CA given or not; None when it is refused."""
        where = "tls_server_config"
        auth_type = self.string(node, "client_auth_type", where) or "NoClientCert"
        if auth_type in UNVERIFIED_CLIENT_AUTH:
            self.problem(
                f"{where}.client_auth_type",
                f"{auth_type} takes a client certificate without verifying it, which protects nothing and which "
                "OpenSSL does not do; use RequireAndVerifyClientCert (or VerifyClientCertIfGiven) with client_ca_file",
            )
            return None
        if auth_type not in CLIENT_AUTH:
            known = ", ".join(CLIENT_AUTH)
            self.problem(f"{where}.client_auth_type", f"unknown client auth type {auth_type!r} (one of {known})")
            return None
        if CLIENT_AUTH[auth_type] == ssl.CERT_NONE and has_ca:
            self.problem(where, "a client CA is given but client_auth_type is NoClientCert: set client_auth_type to "
                         "RequireAndVerifyClientCert to verify clients against it")  # fmt: skip
        if CLIENT_AUTH[auth_type] != ssl.CERT_NONE and not has_ca:
            self.problem(f"{where}.client_ca_file", f"required with client_auth_type {auth_type}: the CA that issues "
                         "the clients' certificates")  # fmt: skip
        return auth_type

    def curves(self, names: list[str]) -> None:
        """`curve_preferences`: checked, and noted as without effect."""
        for name in names:
            if name not in CURVES:
                self.problem(
                    "tls_server_config.curve_preferences",
                    f"unknown curve {name!r} (one of {', '.join(sorted(CURVES))})",
                )
        if names:
            self.notes.append("tls_server_config.curve_preferences: OpenSSL's default groups apply")

    def version(self, node: dict[str, Any], key: str, default: ssl.TLSVersion) -> ssl.TLSVersion:
        name = self.string(node, key, "tls_server_config")
        if name is None:
            return default
        if name in OLD_TLS:
            self.problem(f"tls_server_config.{key}", f"{name} is not supported (TLS 1.2 at least: TLS12 or TLS13)")
            return default
        if name not in TLS_VERSIONS:
            self.problem(f"tls_server_config.{key}", f"unknown TLS version {name!r} (one of {', '.join(TLS_VERSIONS)})")
            return default
        return TLS_VERSIONS[name]

    def ciphers(self, names: list[str]) -> str | None:
        chosen = []
        for name in names:
            if name in CIPHER_SUITES:
                chosen.append(CIPHER_SUITES[name])
            elif name not in TLS13_SUITES:
                self.problem("tls_server_config.cipher_suites", f"unknown or insecure cipher suite {name!r}")
        return ":".join(chosen) or None

    def headers(self, node: object) -> tuple[tuple[str, str], ...]:
        where = "http_server_config.headers"
        headers = []
        for name, value in self.dictionary(node, where).items():
            allowed = HEADERS.get(name)
            if isinstance(value, int | float) and not isinstance(value, bool):
                value = str(value)  # (`X-XSS-Protection: 1`: a number's text, as Go's YAML gives a string field)
            if allowed is None:
                self.problem(f"{where}.{name}", f"cannot be set (one of {', '.join(HEADERS)} can)")
            elif not isinstance(value, str) or re.search(r"[\x00-\x1f\x7f]", value):
                self.problem(f"{where}.{name}", "not a one-line string")
            elif allowed and value not in allowed:
                self.problem(f"{where}.{name}", f"must be one of {', '.join(allowed)}")
            elif value:  # blank: unset, as there
                headers.append((name, value))
        return tuple(headers)

    def users(self, node: object) -> dict[str, bytes]:
        where = "basic_auth_users"
        users = {}
        for name, hashed in self.dictionary(node, where, "not a mapping of user names to bcrypt hashes").items():
            if not isinstance(name, str) or not name or ":" in name:
                self.problem(f"{where}.{name}", "a user name is a non-empty string without `:`")
                continue
            found = BCRYPT_HASH.fullmatch(hashed) if isinstance(hashed, str) else None
            if found is None:  # (the value itself is never repeated: it may be a password written by mistake)
                self.problem(f"{where}.{name}", f"not a bcrypt hash ($2a$, $2b$ or $2y$); {HOW_TO_HASH}")
            elif not 4 <= int(found[1]) <= 31:
                self.problem(f"{where}.{name}", f"a bcrypt cost of {int(found[1])}: it must be 4 to 31")
            else:
                users[name] = hashed.encode()
                if int(found[1]) > BCRYPT_COST_WARNING:
                    self.notes.append(
                        f"{where}.{name}: a bcrypt cost of {int(found[1])} makes each check slow"
                        f" (over {BCRYPT_COST_WARNING}: a quarter of a second or more)"
                    )
        return users
