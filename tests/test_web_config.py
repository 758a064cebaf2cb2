"""`--web.config.file`: exporter-toolkit's web configuration file. Bad files refused with the file and the field (a
table of them); bcrypt users checked once per password; and, over real HTTPS, client certificates, TLS versions and
suites, basic auth and headers, and a reload that reads the file again."""

from __future__ import annotations

import contextlib
import http.client
import logging
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import bcrypt
import pytest
import requests
import trustme
import yaml

from exporter.app.daemon import Daemon
from exporter.config.load import validate
from exporter.core.clock import Clock
from exporter.sim import Simulator
from exporter.web import Credentials, ExporterServer, WebConfigError
from exporter.web import credentials as credentials_module
from exporter.web.credentials import BCRYPT_CACHE, BcryptUsers
from exporter.web.server import _still_serves
from exporter.web.webconfig import read_web_config
from tests.daemon_fakes import InProcessBilling, fake_billing_section
from tests.helpers import logged, scrape, value, wait_for
from tests.test_server import BILLING, start


def hashed(password: str) -> str:
    return bcrypt.hashpw(password.encode(), bcrypt.gensalt(4)).decode()  # cost 4: the tests' time, not safety


def write(path: Path, document: dict) -> Path:
    path.write_text(yaml.safe_dump(document))
    return path


class Files:
    """The server's certificate by the test CA (`ca`), a client CA with a client certificate it issued, and a
    client certificate from a CA the server does not know; all in one directory."""

    def __init__(self, ca: trustme.CA, directory: Path) -> None:
        self.directory = directory
        leaf = ca.issue_cert("127.0.0.1")
        leaf.cert_chain_pems[0].write_to_path(str(directory / "cert.pem"))
        leaf.private_key_pem.write_to_path(str(directory / "key.pem"))
        clients = trustme.CA()
        clients.cert_pem.write_to_path(str(directory / "client-ca.pem"))
        clients.issue_cert("scraper.example").private_key_and_cert_chain_pem.write_to_path(
            str(directory / "client.pem")
        )
        stranger = trustme.CA().issue_cert("scraper.example")
        stranger.private_key_and_cert_chain_pem.write_to_path(str(directory / "stranger.pem"))

    def web_config(self, **document: object) -> Path:
        return write(self.directory / "web.yml", document)


@pytest.fixture
def files(ca: trustme.CA, tmp_path: Path) -> Files:
    return Files(ca, tmp_path)


@pytest.fixture
def serving(clock: Clock) -> Iterator[list[ExporterServer]]:
    """The servers a test starts (`start(..., web_config=...)`), stopped after it."""
    servers: list[ExporterServer] = []
    yield servers
    for server in servers:
        server.stop()


def serve(servers: list[ExporterServer], clock: Clock, web_config: Path) -> ExporterServer:
    server = start({}, clock, web_config=web_config)
    servers.append(server)
    return server


# -- the file --

TLS = {"cert_file": "cert.pem", "key_file": "key.pem"}
BAD_FILES = [
    ({"tls_server_config": {"cert_file": "cert.pem"}}, ["tls_server_config.key_file: required when TLS is on"]),
    (
        {"tls_server_config": TLS | {"min_version": "TLS14"}},
        ["tls_server_config.min_version: unknown TLS version 'TLS14' (one of TLS12, TLS13)"],
    ),
    (  # OpenSSL would refuse every handshake: refused at once rather than started
        {"tls_server_config": TLS | {"max_version": "TLS11"}},
        ["tls_server_config.max_version: TLS11 is not supported (TLS 1.2 at least: TLS12 or TLS13)"],
    ),
    (
        {"tls_server_config": TLS | {"min_version": "TLS13", "max_version": "TLS12"}},
        ["tls_server_config: min_version is above max_version"],
    ),
    (
        {"tls_server_config": TLS | {"client_auth_type": "RequireAndVerifyClientCert"}},
        [
            "tls_server_config.client_ca_file: required with client_auth_type RequireAndVerifyClientCert: the CA that "
            "issues the clients' certificates"
        ],
    ),
    (
        {"tls_server_config": TLS | {"client_ca_file": "client-ca.pem"}},
        [
            "tls_server_config: a client CA is given but client_auth_type is NoClientCert: set client_auth_type to "
            "RequireAndVerifyClientCert to verify clients against it"
        ],
    ),
    (
        {"tls_server_config": TLS | {"client_auth_type": "RequireAnyClientCert", "client_ca_file": "client-ca.pem"}},
        [
            "tls_server_config.client_auth_type: RequireAnyClientCert takes a client certificate without verifying it, "
            "which protects nothing and which OpenSSL does not do; use RequireAndVerifyClientCert (or "
            "VerifyClientCertIfGiven) with client_ca_file"
        ],
    ),
    (
        {"tls_server_config": TLS | {"client_auth_type": "Mutual"}},
        [
            "tls_server_config.client_auth_type: unknown client auth type 'Mutual' (one of NoClientCert, "
            "VerifyClientCertIfGiven, RequireAndVerifyClientCert)"
        ],
    ),
    (
        {"tls_server_config": TLS | {"curve_preferences": ["P256"]}},
        ["tls_server_config.curve_preferences: unknown curve 'P256' (one of CurveP256, CurveP384, CurveP521, X25519)"],
    ),
    (
        {"tls_server_config": TLS | {"cipher_suites": ["TLS_RSA_WITH_3DES_EDE_CBC_SHA"]}},
        ["tls_server_config.cipher_suites: unknown or insecure cipher suite 'TLS_RSA_WITH_3DES_EDE_CBC_SHA'"],
    ),
    (
        {"tls_server_config": TLS | {"client_allowed_sans": ["scraper.example"]}},
        [
            "tls_server_config.client_allowed_sans: not supported by this exporter; issue client certificates from a "
            "CA of their own (client_ca_file) instead"
        ],
    ),
    (
        {"tls_server_config": TLS | {"cert_fil": "x"}, "rate_limit": {"interval": "1s", "burst": 2}},
        [
            "rate_limit: not supported by this exporter",
            "tls_server_config.cert_fil: unknown key (expected one of cert_file, key_file, client_auth_type, "
            "client_ca_file, client_ca, min_version, max_version, cipher_suites, prefer_server_cipher_suites, "
            "curve_preferences)",
        ],
    ),
    (
        {"http_server_config": {"headers": {"X-Frame-Options": "allow-from", "Server": "x"}, "http2": "yes"}},
        [
            "http_server_config.http2: not true or false",
            "http_server_config.headers.Server: cannot be set (one of Strict-Transport-Security, "
            "X-Content-Type-Options, X-Frame-Options, X-XSS-Protection, Content-Security-Policy can)",
            "http_server_config.headers.X-Frame-Options: must be one of deny, sameorigin",
        ],
    ),
    (
        {"basic_auth_users": {"alice": "the-password-itself", "bob": "$2y$03$" + "a" * 53}},
        [
            "basic_auth_users.alice: not a bcrypt hash ($2a$, $2b$ or $2y$); make one with "
            "`htpasswd -nBC 10 \"\" | tr -d ':\\n'`",
            "basic_auth_users.bob: a bcrypt cost of 3: it must be 4 to 31",
        ],
    ),
    (
        {"tls_server_config": TLS, "extra": 1},
        ["extra: unknown key (expected one of tls_server_config, http_server_config, basic_auth_users)"],
    ),
]


@pytest.mark.parametrize(("document", "problems"), BAD_FILES)
def test_a_bad_file_names_itself_and_every_field_at_fault(files: Files, document: dict, problems: list[str]) -> None:
    path = files.web_config(**document)
    with pytest.raises(WebConfigError) as refused:
        read_web_config(path)
    assert refused.value.details == [f"{path}: {problem}" for problem in problems]
    assert "the-password-itself" not in str(refused.value)


def test_files_that_do_not_load_and_yaml_that_does_not_parse(files: Files, tmp_path: Path) -> None:
    server = validate({"billing": BILLING}, {}).server
    path = files.web_config(tls_server_config={"cert_file": "missing.pem", "key_file": "key.pem"})
    with pytest.raises(WebConfigError) as refused:
        Credentials.load(server, path)
    assert refused.value.details == [
        f"{path}: tls_server_config: cannot load the certificate {str(tmp_path / 'missing.pem')!r} with the key "
        f"{str(tmp_path / 'key.pem')!r}: No such file or directory"
    ]
    path = files.web_config(
        tls_server_config=TLS | {"client_auth_type": "RequireAndVerifyClientCert", "client_ca_file": "key.pem"}
    )
    with pytest.raises(WebConfigError, match=r"web\.yml: tls_server_config\.client_ca_file: cannot load '.*key\.pem'"):
        Credentials.load(server, path)
    path = files.web_config(tls_server_config={"cert_file": "cert.pem\0", "key_file": "key.pem"})
    with pytest.raises(WebConfigError, match=r"tls_server_config: cannot load the certificate .*: embedded null byte"):
        Credentials.load(server, path)  # (a NUL in a path: told as any file that does not load, not a traceback)
    path.write_text("tls_server_config:\n  cert_file: [\n")
    with pytest.raises(WebConfigError, match=r"web\.yml: line 3, column 1: invalid YAML"):
        read_web_config(path)
    path.write_text("basic_auth_users:\n  alice: *S3cret\n")  # (a password, not a hash, that YAML reads as an alias)
    with pytest.raises(WebConfigError) as refused:
        read_web_config(path)
    assert "line 2, column 10: invalid YAML: found undefined alias" in str(refused.value)
    assert "S3cret" not in str(refused.value)
    path.write_text("basic_auth_users: {}\nbasic_auth_users: {}\n")
    with pytest.raises(WebConfigError, match="key 'basic_auth_users' is given twice"):
        read_web_config(path)
    with pytest.raises(WebConfigError, match=r"nowhere\.yml: cannot read \(No such file or directory\)"):
        read_web_config(tmp_path / "nowhere.yml")


def test_relative_paths_are_the_files_directory_s(
    files: Files, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = files.web_config(tls_server_config=TLS)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    config = read_web_config(path)
    assert config.tls is not None
    assert config.tls.cert_file == str(tmp_path / "cert.pem")
    assert Credentials.load(validate({"billing": BILLING}, {}).server, path).tls is not None


def test_an_empty_file_secures_nothing(files: Files) -> None:
    path = files.directory / "web.yml"
    path.write_text("")
    credentials = Credentials.load(validate({"billing": BILLING}, {}).server, path)
    assert (credentials.tls, credentials.auth, credentials.headers) == (None, None, ())


def test_curve_preferences_are_taken_and_said_to_change_nothing(files: Files, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    path = files.web_config(tls_server_config=TLS | {"curve_preferences": ["X25519", "CurveP256"]})
    assert Credentials.load(validate({"billing": BILLING}, {}).server, path).tls is not None
    [note] = logged(caplog.records, "web config: accepted without effect", path=str(path))
    assert note.fields["detail"] == "tls_server_config.curve_preferences: OpenSSL's default groups apply"  # type: ignore[attr-defined]


@pytest.mark.parametrize("section", [{"basic_auth": {"username": "u", "password": "p"}}, {"tls": TLS}])
def test_the_file_and_the_configs_own_keys_are_not_both_taken(
    files: Files, section: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(files.directory)
    server = validate({"billing": BILLING, "server": section}, {}).server
    path = files.web_config(basic_auth_users={"alice": hashed("pw")})
    with pytest.raises(WebConfigError) as refused:
        Credentials.load(server, path)
    key = f"server.{next(iter(section))}"
    assert refused.value.details == [
        f"{path}: the config's {key} would secure the server too; use this file or those keys, not both"
    ]


# -- bcrypt, once per password --


@pytest.fixture
def bcrypt_calls(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """The hashes each bcrypt check is made against, in order."""
    calls: list[bytes] = []
    checkpw = bcrypt.checkpw

    def counted(password: bytes, hashed_password: bytes) -> bool:
        calls.append(hashed_password)
        return checkpw(password, hashed_password)

    monkeypatch.setattr(credentials_module.bcrypt, "checkpw", counted)
    return calls


def test_each_outcome_is_remembered_so_a_scrape_costs_no_bcrypt(
    bcrypt_calls: list[bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    alice, bob = hashed("right"), bcrypt.hashpw(b"y" * 72, bcrypt.gensalt(rounds=5)).decode()
    users = BcryptUsers({"alice": alice.encode(), "bob": bob.encode()})
    assert [users.check("alice", "right") for _ in range(3)] == [True] * 3
    assert [users.check("alice", "wrong") for _ in range(3)] == [False] * 3
    assert bcrypt_calls == [alice.encode()] * 2
    costliest = max((alice, bob), key=lambda h: int(h.split("$")[2])).encode()
    assert users.check("mallory", "right") is False  # checked against the costliest user's hash: no faster answer
    assert bcrypt_calls[2] == costliest
    assert users.check("bob", "y" * 72 + "more") is True  # bcrypt reads 72 bytes, as htpasswd and Go do
    assert users.check("alice", "x" * 100) is False
    assert "right" not in repr(users)

    for n in range(3 * BCRYPT_CACHE):  # a flood of wrong passwords never pushes a right one out
        users.check("alice", f"guess-{n}")
    before = len(bcrypt_calls)
    assert users.check("alice", "right") is True
    assert len(bcrypt_calls) == before

    # While bcrypt is busy with others, a password not checked yet is refused at once, not held;
    # one checked right before is still let in without waiting.
    monkeypatch.setattr(credentials_module, "BCRYPT_WAIT", 0.01)
    with users._bcrypt_lock:
        assert users.check("alice", "never-checked") is False
        assert users.check("alice", "right") is True
    assert len(bcrypt_calls) == before
    assert users.check("alice", "never-checked") is False  # asked again once bcrypt is free: checked now
    assert len(bcrypt_calls) == before + 1


def test_scrapes_that_arrive_together_with_a_right_password_are_all_let_in_for_one_check(
    bcrypt_calls: list[bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Several scrapes with the same password, not yet remembered (at start, after a reload), wait
    for the one check that runs; they are let in on its outcome, not refused while each would run
    its own (one at a time, longer than a request may wait)."""
    checkpw = credentials_module.bcrypt.checkpw

    def slow(password: bytes, hashed_password: bytes) -> bool:
        time.sleep(1.0)  # (a costly hash on a busy machine)
        return bool(checkpw(password, hashed_password))

    monkeypatch.setattr(credentials_module.bcrypt, "checkpw", slow)
    monkeypatch.setattr(credentials_module, "BCRYPT_WAIT", 3.0)
    users = BcryptUsers({"alice": hashed("right").encode()})
    answers: list[bool] = []
    threads = [threading.Thread(target=lambda: answers.append(users.check("alice", "right"))) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert answers == [True] * 8
    assert len(bcrypt_calls) == 1


def test_a_reload_keeps_the_passwords_remembered_of_users_it_keeps_as_they_were(bcrypt_calls: list[bytes]) -> None:
    """The users a reload reads again go on from what was remembered: a right password is not
    checked again; a user whose hash changed is, and one the reload removed is let in no more, even
    where the hash it had is another user's (which an unknown user's password is checked against)."""
    alice, bob = hashed("right"), hashed("bobs")
    users = BcryptUsers({"alice": alice.encode(), "bob": bob.encode(), "carol": alice.encode()})
    assert users.check("alice", "right")
    assert users.check("bob", "bobs")
    assert users.check("carol", "right")
    checked = len(bcrypt_calls)
    reloaded = BcryptUsers({"alice": alice.encode(), "bob": hashed("new").encode()}, users)
    assert reloaded.check("alice", "right")
    assert len(bcrypt_calls) == checked  # remembered
    assert not reloaded.check("bob", "bobs")  # another hash: checked again, and wrong now
    assert reloaded.check("bob", "new")
    assert not reloaded.check("carol", "right")  # removed, though alice's hash is the one checked against
    before = BcryptUsers({"alice": alice.encode()})
    assert not before.check("dave", "right")  # unknown: checked against alice's hash, the costliest
    added = BcryptUsers({"alice": alice.encode(), "dave": alice.encode()}, before)
    assert added.check("dave", "right")  # (found wrong while he was unknown: not remembered across)


# -- over HTTP --


@pytest.mark.integration
def test_basic_auth_users_and_headers_over_http(
    files: Files, clock: Clock, serving: list[ExporterServer], bcrypt_calls: list[bytes]
) -> None:
    path = files.web_config(
        basic_auth_users={"alice": hashed("scrape-pass")},
        http_server_config={
            "http2": True,
            # (X-XSS-Protection a number, unquoted as exporter-toolkit's own example writes it: its text is sent)
            "headers": {"X-Content-Type-Options": "nosniff", "X-Frame-Options": "deny", "X-XSS-Protection": 1},
        },
    )
    assert "X-XSS-Protection: 1\n" in path.read_text()
    url = serve(serving, clock, path).url
    refused = requests.get(f"{url}/metrics", timeout=5)
    assert refused.status_code == 401
    assert refused.headers["WWW-Authenticate"].startswith("Basic")
    assert refused.headers["X-Frame-Options"] == "deny"
    assert requests.get(f"{url}/metrics", auth=("alice", "wrong"), timeout=5).status_code == 401
    assert requests.get(f"{url}/metrics", auth=("bob", "scrape-pass"), timeout=5).status_code == 401
    for _ in range(5):
        good = requests.get(f"{url}/metrics", auth=("alice", "scrape-pass"), timeout=5)
        assert good.status_code == 200
        assert "inference_exporter_build_info" in good.text
        assert good.headers["X-Content-Type-Options"] == "nosniff"
        assert good.headers["X-XSS-Protection"] == "1"
    assert len(bcrypt_calls) == 3  # wrong, bob (against the decoy), and alice's right password: once for 5 scrapes
    health = requests.get(f"{url}/healthz", timeout=5)
    assert health.status_code == 200  # open for orchestrators' probes, as with server.basic_auth
    assert health.headers["X-Frame-Options"] == "deny"


def test_a_hash_of_the_right_shape_that_bcrypt_refuses_lets_nobody_in_and_says_so_once(
    files: Files, clock: Clock, serving: list[ExporterServer], caplog: pytest.LogCaptureFixture
) -> None:
    right = hashed("pass")
    refused = (
        right[:28] + ("A" if right[28] != "A" else "B") + right[29:]
    )  # the salt's last character: bcrypt refuses it
    with pytest.raises(ValueError, match="Invalid salt"):
        bcrypt.checkpw(b"pass", refused.encode())
    path = files.web_config(basic_auth_users={"carol": refused, "alice": right})
    url = serve(serving, clock, path).url
    for _ in range(2):
        for user in ("carol", "nobody"):  # the hash's user, and (against the costliest hash) one that is not
            assert requests.get(f"{url}/metrics", auth=(user, "pass"), timeout=5).status_code == 401
    assert requests.get(f"{url}/metrics", auth=("alice", "pass"), timeout=5).status_code == 200
    [said] = logged(caplog.records, "a basic_auth_users hash is not one bcrypt can check: its user cannot log in")
    assert said.fields == {"user": "carol"}  # type: ignore[attr-defined]
    assert not logged(caplog.records, "http request crashed")


def client_tls(
    ca_file: str, certificate: Path | None = None, *, versions: tuple[str, str] = ("TLSv1_2", "TLSv1_3"),
    ciphers: str | None = None,
) -> ssl.SSLContext:  # fmt: skip
    context = ssl.create_default_context(cafile=ca_file)
    context.minimum_version = ssl.TLSVersion[versions[0]]
    context.maximum_version = ssl.TLSVersion[versions[1]]
    if certificate is not None:
        context.load_cert_chain(str(certificate))
    if ciphers is not None:
        context.set_ciphers(ciphers)
    return context


REFUSED = (ssl.SSLError, ConnectionError)
"""What a client sees of a refused handshake: an alert, or the connection cut."""


def fetch(server: ExporterServer, context: ssl.SSLContext) -> tuple[int, str, tuple[str, str, int]]:
    """GET /healthz over a connection with this client context: the status, the TLS version and the cipher. Raises
    one of REFUSED for a refused handshake (with TLS 1.3 the server's refusal of a client certificate comes after
    the client's handshake, at the first read)."""
    with (
        socket.create_connection(server.server_address[:2], timeout=10) as plain,
        context.wrap_socket(plain, server_hostname="127.0.0.1") as connection,
    ):
        connection.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        answer = connection.recv(65536)
        if not answer:
            raise ConnectionResetError("the server closed the connection")
        version, cipher = connection.version(), connection.cipher()
        assert version is not None
        assert cipher is not None
        return int(answer.split()[1]), version, cipher


@pytest.mark.integration
def test_a_request_in_clear_to_the_tls_listener_is_told_so(
    files: Files, clock: Clock, serving: list[ExporterServer], ca_file: str, caplog: pytest.LogCaptureFixture
) -> None:
    """As Go's servers answer it: a 400 in clear that says what happened (a scrape config without
    `scheme: https` would otherwise see only a dropped connection), one log line; TLS clients after
    it are served as before."""
    caplog.set_level(logging.INFO)
    server = serve(serving, clock, files.web_config(tls_server_config=TLS))
    with socket.create_connection(server.server_address[:2], timeout=10) as plain:
        plain.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        answer = b""
        while piece := plain.recv(65536):
            answer += piece
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.split(b"\r\n")[0] == b"HTTP/1.0 400 Bad Request"
    assert body == b"Client sent an HTTP request to an HTTPS server.\n"
    assert [r.fields["status"] for r in logged(caplog.records, "http request refused")] == [400]  # type: ignore[attr-defined]
    assert fetch(server, client_tls(ca_file))[0] == 200


@pytest.mark.integration
@pytest.mark.parametrize(
    ("auth_type", "without_a_certificate"), [("RequireAndVerifyClientCert", False), ("VerifyClientCertIfGiven", True)]
)
def test_a_client_ca_verifies_the_clients_certificates(
    files: Files, clock: Clock, serving: list[ExporterServer], ca_file: str, auth_type: str,
    without_a_certificate: bool,
) -> None:  # fmt: skip
    path = files.web_config(tls_server_config=TLS | {"client_auth_type": auth_type, "client_ca_file": "client-ca.pem"})
    server = serve(serving, clock, path)
    assert server.url.startswith("https://")
    assert fetch(server, client_tls(ca_file, files.directory / "client.pem"))[0] == 200
    certificate = str(files.directory / "client.pem")
    assert requests.get(f"{server.url}/metrics", verify=ca_file, cert=certificate, timeout=5).status_code == 200
    with pytest.raises(REFUSED):  # a certificate from a CA the server does not know
        fetch(server, client_tls(ca_file, files.directory / "stranger.pem"))
    if without_a_certificate:
        assert fetch(server, client_tls(ca_file))[0] == 200
    else:
        with pytest.raises(REFUSED):
            fetch(server, client_tls(ca_file))


@pytest.mark.integration
@pytest.mark.parametrize(
    ("tls", "client", "expected"),
    [
        ({}, {"versions": ("TLSv1_2", "TLSv1_2")}, ("TLSv1.2", None)),
        ({"min_version": "TLS13"}, {"versions": ("TLSv1_2", "TLSv1_2")}, None),
        ({"min_version": "TLS13"}, {}, ("TLSv1.3", None)),
        ({"max_version": "TLS12"}, {"versions": ("TLSv1_3", "TLSv1_3")}, None),
        (
            {"max_version": "TLS12", "cipher_suites": ["TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384"]},
            {},
            ("TLSv1.2", "ECDHE-ECDSA-AES256-GCM-SHA384"),
        ),
        (
            {"max_version": "TLS12", "cipher_suites": ["TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384"]},
            {"ciphers": "ECDHE-ECDSA-AES128-GCM-SHA256"},
            None,
        ),
    ],
)
def test_tls_versions_and_suites_bound_the_handshake(
    files: Files, clock: Clock, serving: list[ExporterServer], ca_file: str, tls: dict, client: dict,
    expected: tuple[str, str | None] | None,
) -> None:  # fmt: skip
    server = serve(serving, clock, files.web_config(tls_server_config=TLS | tls))
    if expected is None:
        with pytest.raises(REFUSED):
            fetch(server, client_tls(ca_file, **client))
        return
    status, version, cipher = fetch(server, client_tls(ca_file, **client))
    assert (status, version) == (200, expected[0])
    if expected[1] is not None:
        assert cipher[0] == expected[1]


# -- a reload reads the file again --


def daemon_on(sim: Simulator, clock: Clock, tmp_path: Path, web: Path) -> tuple[Daemon, dict, Path]:
    """A daemon serving on 127.0.0.1 with the web configuration file `web` (started, unscheduled):
    it, its config document and the config file's path (to reload)."""
    document = {"billing": fake_billing_section(sim), "state": {"path": str(tmp_path / "state.db")}}
    config = write(tmp_path / "config.yaml", document)
    daemon = Daemon(
        validate(document, {}), config_path=config, clock=clock, listen="127.0.0.1:0", web_config=web,
        billing=InProcessBilling(sim),
    )  # fmt: skip
    daemon.start(schedule=False)
    return daemon, document, config


@pytest.mark.integration
def test_a_reload_reads_the_file_again_and_refuses_a_bad_one_whole(
    files: Files, sim: Simulator, clock: Clock, tmp_path: Path, ca_file: str, caplog: pytest.LogCaptureFixture
) -> None:
    web = files.web_config(tls_server_config=TLS, basic_auth_users={"alice": hashed("old-pass")})
    daemon, document, config = daemon_on(sim, clock, tmp_path, web)
    try:
        url = daemon.server.url

        def status(password: str) -> int:
            return requests.get(f"{url}/metrics", auth=("alice", password), verify=ca_file, timeout=5).status_code

        assert (status("old-pass"), status("new-pass")) == (200, 401)
        files.web_config(tls_server_config=TLS, basic_auth_users={"alice": hashed("new-pass")})
        assert daemon.reload() is True
        assert (status("old-pass"), status("new-pass")) == (401, 200)

        files.web_config(tls_server_config=TLS | {"cert_file": "cert.pem\0"}, basic_auth_users={"alice": hashed("x")})
        assert daemon.reload() is False  # (a NUL in a path: refused, not a crash of the reload)
        assert "embedded null byte" in logged(caplog.records, "config reload refused")[-1].fields["error"]  # type: ignore[attr-defined]
        caplog.clear()

        files.web_config(tls_server_config=TLS, basic_auth_users={"alice": "new-pass"})
        assert daemon.reload() is False
        [refusal] = logged(caplog.records, "config reload refused")
        assert refusal.levelno == logging.ERROR
        assert f"{web}: basic_auth_users.alice: not a bcrypt hash" in refusal.fields["error"]  # type: ignore[attr-defined]
        assert status("new-pass") == 200  # the running file's users still
        series = scrape(url, verify=ca_file, auth=("alice", "new-pass"))
        assert value(series, "inference_exporter_config_last_reload_successful") == 0

        files.web_config(tls_server_config=TLS, basic_auth_users={"alice": hashed("new-pass")})
        write(config, document | {"server": {"basic_auth": {"username": "bob", "password": "pw"}}})
        assert daemon.reload() is False  # the config's own basic auth beside the file: refused, not merged
        assert "would secure the server too" in logged(caplog.records, "config reload refused")[-1].fields["error"]  # type: ignore[attr-defined]
        assert requests.get(f"{url}/metrics", auth=("bob", "pw"), verify=ca_file, timeout=5).status_code == 401
    finally:
        daemon.stop(grace=5)


def test_a_reload_that_turns_tls_on_closes_the_plain_connections_kept_alive(
    files: Files, sim: Simulator, clock: Clock, tmp_path: Path, ca_file: str
) -> None:
    """A connection made in clear keeps no access once TLS is required: its next request is not
    answered (closed, as an idle keep-alive connection is), and its client connects again under TLS."""
    daemon, _, _ = daemon_on(sim, clock, tmp_path, files.web_config())
    try:
        host, port = daemon.server.server_address[:2]
        kept = http.client.HTTPConnection(str(host), port, timeout=10)
        try:
            kept.request("GET", "/metrics")
            answer = kept.getresponse()
            assert answer.status == 200
            answer.read()
            files.web_config(tls_server_config=TLS)
            assert daemon.reload()
            with contextlib.suppress(ConnectionError):  # (sent into a connection closed already, maybe)
                kept.request("GET", "/metrics")
            with pytest.raises((http.client.HTTPException, ConnectionError)):  # closed, unanswered
                kept.getresponse()
        finally:
            kept.close()
        assert requests.get(f"{daemon.server.url}/metrics", verify=ca_file, timeout=5).status_code == 200
        assert daemon.server.url.startswith("https://")
    finally:
        daemon.stop(grace=5)


FIRST_REQUESTS = {
    "a scrape": b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    "one expecting 100-continue": (
        b"POST /metrics HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 3\r\nConnection: close\r\n\r\n"
    ),
    "a bad request line": b"GET /metrics HTTP/1.1 extra\r\nHost: x\r\n\r\n",
    "a header too long": b"GET /metrics HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 70000 + b"\r\n\r\n",
    "a request line too long": b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
}


def sent_from_port(port: int, monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """What this process's sockets bound to `port` send in clear from now on (the server's side of
    its connections), recorded as it is sent: a connection the server then closes with the client's
    bytes unread is reset, and the client may never read what it was sent."""
    sent: list[bytes] = []
    for name in ("send", "sendall"):
        original = getattr(socket.socket, name)

        def spy(self: socket.socket, data: bytes, *args: Any, _original: Any = original) -> Any:
            with contextlib.suppress(OSError):
                if self.getsockname()[1] == port:
                    sent.append(bytes(data))
            return _original(self, data, *args)

        monkeypatch.setattr(socket.socket, name, spy)
    return sent


@pytest.mark.parametrize("sent", FIRST_REQUESTS.values(), ids=FIRST_REQUESTS.keys())
def test_a_connection_made_in_clear_before_tls_is_turned_on_gets_no_answer_to_its_first_request(
    files: Files, sim: Simulator, clock: Clock, tmp_path: Path, sent: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Accepted in clear, its request sent only after a reload turned TLS on: nothing is answered in
    clear, not even the stdlib's own refusals or `100 Continue` (its handler was already waiting for
    the request line)."""
    daemon, _, _ = daemon_on(sim, clock, tmp_path, files.web_config())
    answered = sent_from_port(daemon.server.server_address[1], monkeypatch)
    try:
        early = socket.create_connection(daemon.server.server_address[:2], timeout=10)
        with early:
            wait_for(lambda: daemon.server.open_connections == 1)  # (accepted: its handler waits for the request)
            files.web_config(tls_server_config=TLS)
            assert daemon.reload()
            answer = b""
            with contextlib.suppress(ConnectionError):  # (closed while it sent, maybe)
                early.sendall(sent)
                answer = early.recv(200)
            assert answer == b""  # closed, unanswered
            wait_for(lambda: daemon.server.open_connections == 0)  # (its handler done)
        assert answered == []
    finally:
        daemon.stop(grace=5)


def test_a_request_being_answered_when_tls_is_turned_on_is_answered_then_its_connection_closed(
    files: Files, sim: Simulator, clock: Clock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A scrape read and let in before the reload gets its answer; the connection takes no more."""
    from exporter.web import server as module

    daemon, _, _ = daemon_on(sim, clock, tmp_path, files.web_config())
    entered, gate = threading.Event(), threading.Event()
    respond = module.respond

    def held(*args: Any) -> Any:
        entered.set()
        gate.wait(20)
        return respond(*args)

    monkeypatch.setattr(module, "respond", held)
    try:
        host, port = daemon.server.server_address[:2]
        kept = http.client.HTTPConnection(str(host), port, timeout=10)
        try:
            kept.request("GET", "/metrics")
            assert entered.wait(10)
            files.web_config(tls_server_config=TLS)
            assert daemon.reload()
            gate.set()
            answer = kept.getresponse()
            assert answer.status == 200
            assert answer.getheader("Connection") == "close"
            answer.read()
        finally:
            kept.close()
    finally:
        gate.set()
        daemon.stop(grace=5)


def test_a_connection_kept_alive_goes_on_after_a_reload_only_if_the_new_tls_would_take_it(files: Files) -> None:
    server = validate({"billing": BILLING}, {}).server

    def tls(**settings: object) -> ssl.SSLContext | None:
        return Credentials.load(server, files.web_config(**settings)).tls

    verified = TLS | {"client_auth_type": "RequireAndVerifyClientCert", "client_ca_file": "client-ca.pem"}
    plain, served, renewed = None, tls(tls_server_config=TLS), tls(tls_server_config=TLS)
    asking, asking_again = tls(tls_server_config=verified), tls(tls_server_config=verified)
    assert _still_serves(served, renewed)  # a renewed certificate: its session goes on
    assert _still_serves(asking, asking_again)  # the same client certificates asked for
    assert not _still_serves(plain, served)  # made in clear: TLS is on now
    assert not _still_serves(served, plain)
    assert not _still_serves(served, asking)  # made without the client certificate now asked for
