"""What the HTTP server does with requests that are malformed or ambiguous, over raw sockets to a real server:
a 400 that closes the connection and one log line, never a traceback; and gzip only when it is acceptable (the
negotiation's cases in process, a few of them over the wire)."""

from __future__ import annotations

import gzip
import logging
import socket
from collections.abc import Iterator

import pytest

from exporter.config.load import validate
from exporter.core.clock import Clock
from exporter.core.logs import LogfmtFormatter
from exporter.model.snapshots import Latest
from exporter.web import ExporterServer, View, accepts_gzip
from tests.test_server import BILLING, start


def our_traceback(err: str) -> bool:
    """A traceback of the exporter's own code on stderr. (The worker's stderr is the process's: a
    library thread another test left, such as aiosmtpd's, may print its own there meanwhile.)"""
    return "Traceback" in err and "/exporter/" in err


@pytest.fixture
def server(clock: Clock) -> Iterator[ExporterServer]:
    """A server whose kept-alive connections close after 2 s, so that reading to the end never waits long."""
    server = start({}, clock, idle_deadline=2.0)
    yield server
    server.stop()


def exchange(server: ExporterServer, data: bytes) -> bytes:
    """Send `data` on a new connection and read until the server hangs up."""
    received = []
    with socket.create_connection(server.server_address[:2], timeout=10) as client:
        client.sendall(data)
        while chunk := client.recv(65536):
            received.append(chunk)
    return b"".join(received)


def responses(raw: bytes) -> list[tuple[int, dict[str, str]]]:
    """Each response's status and headers (names in lower case), in the order they came."""
    found = []
    for part in raw.split(b"HTTP/1.1 ")[1:]:
        head = part.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
        headers = dict(line.split(": ", 1) for line in head[1:] if ": " in line)
        found.append((int(head[0].split()[0]), {name.lower(): value for name, value in headers.items()}))
    return found


def refused(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """The server's log records at info or above."""
    return [r for r in caplog.records if r.name == "exporter.web.server" and r.levelno >= logging.INFO]


MALFORMED = {
    "no request line": b"GARBAGE\r\n\r\n",  # the stdlib's refusal, with a status line: HTTP/0.9 has none
    "an unparseable target": b"GET http://[x/ HTTP/1.1\r\nHost: x\r\n\r\n",
    "a target that is no path": b"GET metrics HTTP/1.1\r\nHost: x\r\n\r\n",
    "two Content-Length": b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nContent-Length: 20\r\n\r\n"
    b"GET /healthz HTTP/1.1\r\n\r\n",
    "a Content-Length that is no number": b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 0, 0\r\n\r\n",
    "a space before the colon": b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length : 5\r\n\r\nhello",
    "a line with no colon": b"GET /healthz HTTP/1.1\r\nHost: x\r\nno colon here\r\nContent-Length: 5\r\n\r\nhello",
    "a folded header": b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-A: a\r\n folded\r\n\r\n",
    "a control character in a value": b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n",
    "Transfer-Encoding and Content-Length": b"GET /healthz HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
    b"Content-Length: 5\r\n\r\n0\r\n\r\n",
    "two Host": b"GET /healthz HTTP/1.1\r\nHost: x\r\nHost: y\r\n\r\n",
    "no Host in HTTP/1.1": b"GET /healthz HTTP/1.1\r\n\r\n",
    "a long bad request line": b"GET /healthz HTTP/1.1" + b"A" * 2000 + b"\r\nHost: x\r\n\r\n",  # echoed in the reason
}


@pytest.mark.parametrize("request_bytes", MALFORMED.values(), ids=MALFORMED.keys())
def test_a_malformed_request_is_a_400_that_closes_the_connection_and_one_log_line(
    server: ExporterServer,
    request_bytes: bytes,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
) -> None:
    caplog.set_level(logging.DEBUG)
    answer = exchange(server, request_bytes)
    assert [status for status, _ in responses(answer)] == [400]  # nothing smuggled after it is answered
    assert responses(answer)[0][1]["connection"] == "close"
    lines = refused(caplog)
    assert len(lines) == 1
    assert lines[0].getMessage() == "http request refused"
    assert lines[0].fields["status"] == 400  # type: ignore[attr-defined]
    assert "\n" not in LogfmtFormatter().format(lines[0])
    assert not our_traceback(capfd.readouterr().err)
    assert exchange(server, b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").endswith(b"ok\n")


def test_an_absolute_target_is_served(server: ExporterServer) -> None:
    """RFC 9112 §3.2.2: a server accepts the absolute form of a target."""
    answer = exchange(server, b"GET http://127.0.0.1/healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert [status for status, _ in responses(answer)] == [200]


def test_a_target_holding_a_password_is_refused_and_never_logged(
    server: ExporterServer, caplog: pytest.LogCaptureFixture
) -> None:
    """RFC 9110 §4.2.4: a user name or password in the target is an error; what a proxy forwarded as
    it was never reaches the log (refused, or in the access line at debug)."""
    caplog.set_level(logging.DEBUG)
    for request in (
        b"GET http://scraper:Sup3rSecretPw@127.0.0.1/metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        b"POST http://scraper:Sup3rSecretPw@127.0.0.1/metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n",
    ):
        answer = exchange(server, request)
        assert [status for status, _ in responses(answer)] == [400]
    # (A path that begins with `//`, which a URL parser would read as an authority: the stdlib takes
    # it as the path it is, and no such path is served.)
    answer = exchange(server, b"GET //scraper:Sup3rSecretPw@127.0.0.1/metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    assert [status for status, _ in responses(answer)] == [404]
    assert "Sup3rSecretPw" not in caplog.text
    # A request line the stdlib cannot read (four words: a space in the password) is quoted in its reason.
    answer = exchange(server, b"GET http://scraper:Sup3r Secret@127.0.0.1/metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    assert [status for status, _ in responses(answer)] == [400]
    assert b"Secret" not in answer
    assert "Secret@" not in caplog.text
    assert [r.fields["reason"] for r in refused(caplog)][:2] == [
        "bad request: a target holding a user name or password"
    ] * 2  # type: ignore[attr-defined]
    exchange(server, b"GET /healthz?u=http://scraper:Sup3rSecretPw@x HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert "Sup3rSecretPw" not in caplog.text  # (the access line, at debug)


def test_an_unexpected_exception_in_a_handler_is_a_500_and_one_log_line(
    caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    def broken(accept: str) -> tuple[bytes, str]:
        raise RuntimeError("a bug in the exposition")

    server = ExporterServer(("127.0.0.1", 0), View(Latest(), broken, list), validate({"billing": BILLING}, {}).server)
    server.start()
    caplog.set_level(logging.DEBUG)
    try:
        answer = exchange(server, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        assert [(status, headers["connection"]) for status, headers in responses(answer)] == [(500, "close")]
        lines = refused(caplog)
        assert len(lines) == 1
        assert lines[0].levelno == logging.ERROR
        assert "\n" not in LogfmtFormatter().format(lines[0])  # the traceback is a field of the line
        assert not our_traceback(capfd.readouterr().err)
        healthz = exchange(server, b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert [status for status, _ in responses(healthz)] == [200]
    finally:
        server.stop()


GZIP = {
    "gzip": True,
    "GZIP": True,
    "x-gzip": True,
    "gzip, deflate, br": True,
    "gzip;q=0": False,
    "gzip; q=0.000": False,
    "gzip;Q=0": False,
    "gzip;q=0.5, identity;q=1": False,
    "gzip;q=1, identity;q=0.5": True,
    "*": True,
    "*;q=0": False,
    "*;q=0, gzip": True,
    "*, gzip;q=0": False,
    "deflate, *;q=0.1": True,
    "identity": False,
    "br": False,
    "": False,
    "gzip;q=2": False,  # not a q-value: not taken as acceptable
    "gzip;q=abc": False,
}


@pytest.mark.parametrize(("accept_encoding", "gzipped"), GZIP.items(), ids=[repr(k) for k in GZIP])
def test_gzip_only_when_the_client_finds_it_acceptable(accept_encoding: str, gzipped: bool) -> None:
    assert accepts_gzip([accept_encoding]) is gzipped


@pytest.mark.integration  # a real server
@pytest.mark.parametrize("accept_encoding", ["gzip, deflate, br", "gzip;q=0", "*;q=0, gzip", "br"])
def test_the_server_gzips_what_the_negotiation_accepts(server: ExporterServer, accept_encoding: str) -> None:
    answer = exchange(
        server,
        f"GET /metrics HTTP/1.1\r\nHost: x\r\nAccept-Encoding: {accept_encoding}\r\nConnection: close\r\n\r\n".encode(),
    )
    [(status, headers)] = responses(answer)
    assert status == 200
    gzipped = accepts_gzip([accept_encoding])
    assert (headers.get("content-encoding") == "gzip") is gzipped
    body = answer.split(b"\r\n\r\n", 1)[1]
    assert b"inference_exporter_build_info" in (gzip.decompress(body) if gzipped else body)
