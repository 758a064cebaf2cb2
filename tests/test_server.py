"""The HTTP server's optional TLS and basic auth, with real clients."""

from __future__ import annotations

import select
import socket
import ssl
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from exporter.app.account import build_exposition
from exporter.app.daemon import parse_listen
from exporter.config.load import validate
from exporter.core.clock import Clock
from exporter.metrics.exposition import OPENMETRICS_ACCEPT, negotiated
from exporter.model.snapshots import Latest
from exporter.sim import Simulator, SimulatorServer
from exporter.web import ExporterServer, View
from exporter.web.views import awaited, ready
from tests.conftest import require_binary
from tests.helpers import free_port, wait_for

BILLING = {"url": "http://127.0.0.1:1", "access_key_id": "AK", "secret_access_key": "s"}


def start(
    server_section: dict, clock: Clock, address: tuple[str, int] = ("127.0.0.1", 0), **limits: Any
) -> ExporterServer:
    config = validate({"billing": BILLING, "server": server_section}, {})
    latest = Latest()
    exposition = build_exposition(config, latest, clock)
    view = View(
        latest,
        exposition.render,
        lambda: ["bills", "usage"],
        render_gzipped=lambda accept: exposition.render(accept, gzipped=True),
    )
    server = ExporterServer(address, view, config.server, **limits)
    server.start()
    return server


def dribble(client: socket.socket, interval: float, path: str = "/metrics") -> tuple[float, bytes]:
    """Send a request line, then a header line every `interval` seconds, until the server hangs up (or 60 s pass).
    The seconds that took, and what the server sent (nothing, or an error, once it hung up)."""
    started = time.monotonic()
    client.setblocking(False)  # a readable TLS socket may hold just a session ticket: recv must not wait on it
    client.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n".encode())
    for line in range(int(60 / interval)):
        readable, _, _ = select.select([client], [], [], interval)
        try:
            if readable:
                return time.monotonic() - started, client.recv(65536)
            client.sendall(f"X-Slow-{line}: v\r\n".encode())
        except ssl.SSLWantReadError:  # that ticket, no data
            continue
        except OSError:  # reset, or a TLS error: hung up all the same
            return time.monotonic() - started, b""
    raise AssertionError("the server never hung up on the slow client")


@pytest.fixture
def certificate(tmp_path: Path) -> tuple[Path, Path]:
    openssl = require_binary("openssl")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return cert, key


@pytest.fixture
def auth_server(clock: Clock) -> Iterator[ExporterServer]:
    server = start({"basic_auth": {"username": "prometheus", "password": "scrape-pass"}}, clock)
    yield server
    server.stop()


def test_basic_auth_guards_metrics_but_not_health(auth_server: ExporterServer) -> None:
    url = auth_server.url
    assert requests.get(f"{url}/metrics", timeout=5).status_code == 401
    assert requests.get(f"{url}/metrics", auth=("prometheus", "wrong"), timeout=5).status_code == 401
    assert requests.get(f"{url}/metrics", auth=("other", "scrape-pass"), timeout=5).status_code == 401
    good = requests.get(f"{url}/metrics", auth=("prometheus", "scrape-pass"), timeout=5)
    assert good.status_code == 200
    assert "inference_exporter_build_info" in good.text
    assert requests.get(f"{url}/", timeout=5).status_code == 401
    assert requests.get(f"{url}/healthz", timeout=5).status_code == 200
    assert requests.get(f"{url}/readyz", timeout=5).status_code == 503


def test_tls_serves_metrics_to_a_verifying_client(certificate: tuple[Path, Path], clock: Clock) -> None:
    cert, key = certificate
    server = start({"tls": {"cert_file": str(cert), "key_file": str(key)}}, clock)
    try:
        assert server.url.startswith("https://")
        response = requests.get(f"{server.url}/metrics", verify=str(cert), timeout=5)
        assert response.status_code == 200
        assert "inference_billing_today_info" in response.text
        with pytest.raises(requests.exceptions.SSLError):
            requests.get(f"{server.url}/metrics", timeout=5)  # an unknown CA is refused
    finally:
        server.stop()


def ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback on this machine")
def test_an_ipv6_listen_address_is_served(clock: Clock) -> None:
    """`--web.listen-address [::1]:9877`, as docs/web-config.md shows it (and the simulator's `--listen`)."""
    host, port = parse_listen("[::1]:0")
    server = start({}, clock, (host, port))
    sim = SimulatorServer((host, port), Simulator())
    sim.start()
    try:
        assert server.url.startswith("http://[::1]:")
        assert requests.get(f"{server.url}/healthz", timeout=5).status_code == 200
        assert sim.url.startswith("http://[::1]:")
        assert requests.get(f"{sim.url}/", timeout=5).status_code == 404  # (an API's base address: no page)
    finally:
        server.stop()
        sim.stop()


@pytest.mark.skipif(not socket.has_dualstack_ipv6(), reason="no IPv6 beside IPv4 on this machine")
def test_a_listen_address_without_a_host_is_served_on_ipv6_and_ipv4(clock: Clock) -> None:
    """`:9877` (the default `server.listen`) is every address, as Go's exporters take it: an IPv6-only
    cluster's kubelet and Prometheus reach the pod too."""
    server = start({}, clock, parse_listen(":0"))
    try:
        port = server.server_address[1]
        for url in (f"http://127.0.0.1:{port}", f"http://[::1]:{port}"):
            assert requests.get(f"{url}/healthz", timeout=5).status_code == 200, url
    finally:
        server.stop()


@pytest.mark.parametrize("address", ["::1:9877", "[::1:9877", "[::1]]:9877", "host:", "host:65536", "host:٣", "9877"])
def test_a_listen_address_that_is_not_host_and_port_is_refused(address: str) -> None:
    """An IPv6 address without its brackets (or with one), a port missing, too large or not in ASCII digits."""
    with pytest.raises(ValueError, match="is not HOST:PORT"):
        parse_listen(address)


def test_the_server_header_names_the_program_not_the_interpreter(clock: Clock) -> None:
    server = start({}, clock)
    try:
        for path in ("/metrics", "/healthz", "/nowhere"):
            response = requests.get(f"{server.url}{path}", timeout=5)
            assert response.headers["Server"] == "inference-cost-exporter", path
    finally:
        server.stop()


def test_gzip_and_openmetrics_negotiation(clock: Clock) -> None:
    server = start({}, clock)
    try:
        gz = requests.get(f"{server.url}/metrics", headers={"Accept-Encoding": "gzip"}, timeout=5)
        assert gz.headers["Content-Encoding"] == "gzip"
        assert "inference_exporter_build_info" in gz.text
        om = requests.get(f"{server.url}/metrics", headers={"Accept": "application/openmetrics-text"}, timeout=5)
        assert om.headers["Content-Type"].startswith("application/openmetrics-text")
        assert om.text.endswith("# EOF\n")
        # What the body depends on, for a cache in front: the format and the coding on /metrics, the coding elsewhere.
        assert gz.headers["Vary"] == om.headers["Vary"] == "Accept, Accept-Encoding"
        assert requests.get(f"{server.url}/", timeout=5).headers["Vary"] == "Accept-Encoding"
        assert requests.get(f"{server.url}/nope", timeout=5).status_code == 404
    finally:
        server.stop()


PROMETHEUS_3_ACCEPT = (
    "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.5,application/openmetrics-text;"
    "version=0.0.1;q=0.4,text/plain;version=1.0.0;escaping=allow-utf-8;q=0.3,text/plain;version=0.0.4;q=0.2,*/*;q=0.1"
)


@pytest.mark.parametrize(
    ("accept", "openmetrics"),
    [
        ("application/openmetrics-text", True),
        (PROMETHEUS_3_ACCEPT, True),
        ("application/openmetrics-text; version=1.0.0; q=0, text/plain; version=0.0.4", False),  # refused
        ("text/plain; version=0.0.4; q=1, application/openmetrics-text; version=1.0.0; q=0.1", False),  # text preferred
        ("application/openmetrics-text; q=0.5, */*; q=0.5", True),  # as good: OpenMetrics
        ("application/openmetrics-text; q=2", False),  # not a weight: 0
        ('application/openmetrics-text; version="1.0.0"; q=0.5', False),  # a quoted version: never a crash
        ("application/openmetrics-text; version=zzz", False),
        ("", False),
    ],
)
def test_openmetrics_is_served_when_the_client_weighs_it_at_least_as_the_text_format(
    accept: str, openmetrics: bool
) -> None:
    assert (negotiated(accept) == OPENMETRICS_ACCEPT) is openmetrics


def test_every_accept_header_is_served_one_of_two_formats_from_the_same_caches(clock: Clock) -> None:
    """Prometheus 3's header, made-up versions and escapings get OpenMetrics 1.0.0 or the text
    format 0.0.4, the bytes `prepare` rendered: each variant cached apart missed them, and a client
    making up versions grew the caches with every one."""
    server = start({}, clock)
    try:
        exposition = server.view.render.__self__  # type: ignore[attr-defined]  # (the bound render of `start`)
        openmetrics, text = (server.view.render(accept)[0] for accept in (OPENMETRICS_ACCEPT, ""))
        asked = [PROMETHEUS_3_ACCEPT, "text/plain;version=1.0.0;escaping=allow-utf-8", "*/*"]
        asked += [f"application/openmetrics-text; version=1.0.{n}" for n in range(20)]
        for accept in asked:
            response = requests.get(f"{server.url}/metrics", headers={"Accept": accept}, timeout=5)
            om = accept != "*/*" and not accept.startswith("text/plain")
            assert response.headers["Content-Type"] == (
                "application/openmetrics-text; version=1.0.0; charset=utf-8; escaping=underscores"
                if om
                else "text/plain; version=0.0.4; charset=utf-8"
            ), accept
            assert response.content == (openmetrics if om else text)
        assert {content_type for _, content_type in exposition._cache} == {
            "text/plain; version=0.0.4; charset=utf-8",
            "application/openmetrics-text; version=1.0.0; charset=utf-8; escaping=underscores",
        }
    finally:
        server.stop()


def test_tls_files_must_exist() -> None:
    from exporter.config.load import ConfigError

    with pytest.raises(ConfigError, match=r"server\.tls: file '/nonexistent\.pem' does not exist"):
        validate({"billing": BILLING, "server": {"tls": {"cert_file": "/nonexistent.pem", "key_file": "/x"}}}, {})


def test_request_limits(clock: Clock) -> None:
    import http.client

    server = start({}, clock)
    try:
        host, port = server.server_address[:2]

        def send(method: str, path: str, headers: dict[str, str] | None = None, body: bytes | None = None) -> int:
            connection = http.client.HTTPConnection(host, port, timeout=5)
            connection.request(method, path, body=body, headers=headers or {})
            status = connection.getresponse().status
            connection.close()
            return status

        assert send("GET", "/metrics") == 200
        assert send("POST", "/metrics", body=b"x" * 10) == 405
        assert send("DELETE", "/") == 405
        assert send("GET", "/metrics?" + "a" * 9000) == 414
        assert send("GET", "/metrics", {f"X-Filler-{i}": "v" * 200 for i in range(90)}) == 431
        assert send("GET", "/metrics", {f"X-{i}": "v" for i in range(120)}) == 431  # over 100 header lines
        assert send("GET", "/metrics", body=b"unexpected") == 413
        assert send("GET", "/healthz") == 200  # and the server still answers
    finally:
        server.stop()


def test_a_silent_tls_client_does_not_block_the_server(certificate: tuple[Path, Path], clock: Clock) -> None:
    cert, key = certificate
    server = start({"tls": {"cert_file": str(cert), "key_file": str(key)}}, clock)
    silent = socket.create_connection(server.server_address[:2])  # connects, never says hello
    try:
        response = requests.get(f"{server.url}/healthz", verify=str(cert), timeout=5)
        assert response.status_code == 200
    finally:
        silent.close()
        server.stop()


def test_a_slow_tls_client_is_cut_at_the_header_deadline(certificate: tuple[Path, Path], clock: Clock) -> None:
    cert, key = certificate
    server = start({"tls": {"cert_file": str(cert), "key_file": str(key)}}, clock, header_deadline=1.0)
    address = server.server_address[:2]
    silent = socket.create_connection(address, timeout=10)  # never says hello: the handshake is on the clock too
    context = ssl.create_default_context(cafile=str(cert))
    connected = time.monotonic()
    slow = context.wrap_socket(socket.create_connection(address, timeout=10), server_hostname="127.0.0.1")
    try:
        took, answer = dribble(slow, 0.3)  # handshake done, then the headers dribble in
        assert answer == b""
        assert took < 6
        assert time.monotonic() - connected >= 0.9  # the deadline ran from the connection, handshake included
        assert silent.recv(1) == b""  # cut as well, though it was never read from
        wait_for(lambda: server.timed_out == 2, timeout=10)
        assert requests.get(f"{server.url}/healthz", verify=str(cert), timeout=5).status_code == 200
    finally:
        silent.close()
        slow.close()
        server.stop()


def test_a_failed_connection_says_the_host_and_why(certificate: tuple[Path, Path], clock: Clock) -> None:
    from exporter.billing import BillingClient, BillingUnavailable, RetryPolicy

    cert, key = certificate
    server = start({"tls": {"cert_file": str(cert), "key_file": str(key)}}, clock)
    closed = free_port()
    cases = {
        server.url: "TLS certificate verification failed (self-signed certificate)",
        f"http://127.0.0.1:{closed}": "connection refused",
        "http://no-such-host.invalid": "the host name does not resolve (DNS)",
    }
    try:
        for url, cause in cases.items():
            client = BillingClient(
                url, requests.auth.HTTPBasicAuth("u", "p"), tz=clock.tz, retry=RetryPolicy(attempts=1)
            )
            with client, pytest.raises(BillingUnavailable) as failure:
                client.bills("2026-11", "GROUP_TERM_ITEM")
            host = url.split("://", 1)[1]
            assert f"connection to {host} failed: {cause}" in str(failure.value)
    finally:
        server.stop()


def test_a_kept_alive_connection_answers_as_fast_as_a_fresh_one(clock: Clock) -> None:
    """Prometheus reuses its connection: a response must not wait for the client's delayed ACK."""
    import http.client
    import statistics

    server = start({}, clock)
    port = server.server_address[1]

    def timed(connection: http.client.HTTPConnection) -> float:
        started = time.perf_counter()
        connection.request("GET", "/healthz")
        connection.getresponse().read()
        return time.perf_counter() - started

    try:
        kept = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        timed(kept)
        reused, fresh = [], []
        for _ in range(15):
            reused.append(timed(kept))
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            fresh.append(timed(connection))
            connection.close()
        kept.close()
    finally:
        server.stop()
    assert statistics.median(reused) <= 2 * statistics.median(fresh)  # before: 44 ms against 1 ms


def test_a_gzipped_metrics_body_is_one_gzip_member(clock: Clock) -> None:
    """One member: curl and other libcurl clients stop after the first member of a gzip stream."""
    import http.client
    import zlib

    server = start({}, clock)
    try:
        for accept in ("", "application/openmetrics-text; version=1.0.0"):
            connection = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=10)
            connection.request("GET", "/metrics", headers={"Accept-Encoding": "gzip", "Accept": accept})
            response = connection.getresponse()
            body = response.read()
            connection.close()
            assert response.getheader("Content-Encoding") == "gzip"
            reader = zlib.decompressobj(16 + zlib.MAX_WBITS)  # gzip, one member
            assert reader.decompress(body) == server.view.render(accept)[0]
            assert reader.eof
            assert reader.unused_data == b""
    finally:
        server.stop()


def test_curl_compressed_reads_the_whole_metrics_body(clock: Clock) -> None:
    """curl decodes one gzip member and stops: the body it prints must be the whole exposition."""
    curl = require_binary("curl")
    server = start({}, clock)
    try:
        for accept in ("", "application/openmetrics-text; version=1.0.0"):
            fetched = subprocess.run(
                [curl, "--silent", "--show-error", "--fail", "--compressed", "--dump-header", "-",
                 "--header", f"Accept: {accept}", f"{server.url}/metrics"],
                capture_output=True, check=True, timeout=30,
            )  # fmt: skip
            headers, _, body = fetched.stdout.partition(b"\r\n\r\n")
            assert b"content-encoding: gzip" in headers.lower()
            assert body == server.view.render(accept)[0]
    finally:
        server.stop()


def test_a_web_config_files_headers_come_on_refusals_too(tmp_path: Path, clock: Clock) -> None:
    """`http_server_config.headers` are the server's, on every answer: a refused method and a 404 too."""
    import http.client

    web = tmp_path / "web.yml"
    web.write_text("http_server_config:\n  headers:\n    X-Frame-Options: sameorigin\n")
    server = start({}, clock, web_config=web)
    try:
        host, port = server.server_address[:2]
        for method, path, expected in (("POST", "/metrics", 405), ("GET", "/nope", 404), ("GET", "/metrics", 200)):
            connection = http.client.HTTPConnection(host, port, timeout=5)
            connection.request(method, path)
            response = connection.getresponse()
            assert (response.status, response.getheader("X-Frame-Options")) == (expected, "sameorigin")
            connection.close()
    finally:
        server.stop()


def test_a_response_to_a_request_that_closes_its_connection_says_so(clock: Clock) -> None:
    """The server closes it after the answer, and says `Connection: close` in it (RFC 9112 §9.6)."""
    server = start({}, clock)
    try:
        for options in (b"close", b"TE, close"):  # (`close` among other options too)
            with socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1])), timeout=5) as client:
                client.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: " + options + b"\r\n\r\n")
                answer = b""
                while chunk := client.recv(65536):  # (to its end: the server closes it)
                    answer += chunk
            head = answer.split(b"\r\n\r\n", 1)[0].decode().lower().split("\r\n")
            assert head[0] == "http/1.1 200 ok"
            assert "connection: close" in head
    finally:
        server.stop()


def test_readiness_read_across_a_reload_that_makes_several_accounts_waits_for_the_new_ones() -> None:
    """/readyz reads the sources, the health and what it waits for one after another: a reload
    from one account to `x` and `y` landing between the reads (the old names, the old health, the
    new names awaited) is not ready (it had matched no name, and waited for nothing)."""
    latest = Latest()
    for source in ("bills", "usage"):
        latest.record(source, success=True, at=time.time(), duration=0.1)
    new = ["x/bills", "x/usage", "y/bills", "y/usage"]
    view = View(latest, render=lambda accept: (b"", ""), sources=lambda: ["bills", "usage"], awaited=lambda: new)
    is_ready, _ = ready(view)
    assert not is_ready
    assert awaited(view) == new
