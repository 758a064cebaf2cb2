"""The notifiers' POST: one deadline for the whole exchange, whatever phase a receiver stalls in."""

from __future__ import annotations

import contextlib
import http.client
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from exporter.core.post import DeadlineExceeded, peers, post_json
from tests.helpers import Receiver


@contextmanager
def dribbling(opening: bytes, byte: bytes, every: float, *, reads_request: bool) -> Iterator[int]:
    """A listener on loopback (its port) that, once connected (and, with `reads_request`, once the
    request arrives), sends `opening`, then `byte` every `every` seconds, until the block ends."""
    listener, stop = socket.socket(), threading.Event()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)

    def serve() -> None:
        connection, _ = listener.accept()
        with connection:
            if reads_request:
                connection.recv(65536)
            connection.sendall(opening)
            while not stop.wait(every):
                try:
                    connection.sendall(byte)
                except OSError:
                    return

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        listener.close()


@pytest.fixture
def dribbler() -> Iterator[int]:
    """A listener that, once connected, sends the start of a TLS record announcing 16 KiB, then one
    byte every 0.3 s: a TLS handshake that never ends, though no read ever waits long."""
    with dribbling(bytes([0x16, 0x03, 0x03, 0x40, 0x00]), b"\x00", 0.3, reads_request=False) as port:
        yield port


def test_a_tls_handshake_that_dribbles_is_cut_at_the_deadline(dribbler: int) -> None:
    port = dribbler
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded):
        post_json(f"https://127.0.0.1:{port}/hook", {"x": 1}, deadline=1.0, headers={})
    assert time.monotonic() - started < 4  # 1 s, and a busy machine's slack; without the cut it never ends


ANSWER_HEADS = {
    "the connection's end": b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n",
    "a length": b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n",
    "chunks": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3e8\r\n",
}


@pytest.mark.parametrize("delimited_by", ANSWER_HEADS)
def test_an_answer_whose_body_dribbles_past_the_deadline_is_no_answer(delimited_by: str) -> None:
    """However its body ends, a 2xx whose body was still coming when the deadline cut it is
    `DeadlineExceeded` (one that ends with the connection looked whole once cut, and counted as
    delivered, while the others were retried)."""
    with dribbling(ANSWER_HEADS[delimited_by], b"x", 0.2, reads_request=True) as port, pytest.raises(DeadlineExceeded):
        post_json(f"http://127.0.0.1:{port}/hook", {"x": 1}, deadline=0.6, headers={})


def test_credentials_in_the_url_are_sent_as_basic_auth(receiver: Receiver) -> None:
    url = receiver.url.replace("http://", "http://hook-user:s%3Acret@") + "/hook"
    assert post_json(url, {"x": 1}, deadline=5, headers={}).status == 200
    (received,) = receiver.received
    assert received["headers"]["Authorization"] == "Basic aG9vay11c2VyOnM6Y3JldA=="  # hook-user:s:cret
    assert received["body"] == {"x": 1}


def test_a_proxy_whose_port_is_out_of_range_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """The environment's proxy is not checked with the config: its address, wrong, is an HTTP error
    naming whose port it is, and no address (it may hold a password)."""
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTP_PROXY", "http://user:pw@proxy.example:99999")
    with pytest.raises(http.client.InvalidURL, match=r"^the proxy's port is not a number from 1 to 65535$"):
        post_json("http://receiver.example/hook", {"x": 1}, deadline=5, headers={})
    monkeypatch.setenv("HTTP_PROXY", "http://[proxy.example:8080")  # (no closing bracket)
    with pytest.raises(http.client.InvalidURL, match=r"^the URL or its proxy's address cannot be read$"):
        post_json("http://receiver.example/hook", {"x": 1}, deadline=5, headers={})


@contextmanager
def proxy_seeing(monkeypatch: pytest.MonkeyPatch, scheme: str) -> Iterator[list[bytes]]:
    """A proxy on loopback for `scheme` (set in the environment) that answers each request 200 (a
    CONNECT 502); yields the request lines it saw."""
    seen: list[bytes] = []
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(2)

    def proxy() -> None:
        with contextlib.suppress(OSError):
            connection, _ = listener.accept()
            with connection:
                seen.append(connection.recv(65536).split(b"\r\n")[0])
                status = b"502 Bad Gateway" if seen[-1].startswith(b"CONNECT") else b"200 OK"
                connection.sendall(b"HTTP/1.1 " + status + b"\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")

    threading.Thread(target=proxy, daemon=True).start()
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(f"{scheme.upper()}_PROXY", f"http://127.0.0.1:{listener.getsockname()[1]}")
    try:
        yield seen
    finally:
        listener.close()


@pytest.mark.parametrize("scheme", ["http", "https"])
@pytest.mark.parametrize(("host", "written"), [("bücher.example", "xn--bcher-kva.example"),
                                               ("faß.example", "xn--fa-hia.example")])  # fmt: skip
def test_a_host_name_beyond_ascii_goes_through_a_proxy_in_its_xn_form(
    monkeypatch: pytest.MonkeyPatch, scheme: str, host: str, written: str
) -> None:
    """The proxy's request line (`POST http://host/…`), or its CONNECT, is ASCII: the host goes in
    its IDNA form as requests writes it (it raised UnicodeEncodeError, which crashed the notifier's
    delivery at every poll; `faß` is never `fass`, another domain)."""
    with proxy_seeing(monkeypatch, scheme) as seen:
        if scheme == "http":
            assert post_json(f"http://{host}/hook", {"x": 1}, deadline=5, headers={}).status == 200
        else:
            with pytest.raises(OSError, match="502"):  # (the tunnel refused: a failed delivery, retried)
                post_json(f"https://{host}/hook", {"x": 1}, deadline=5, headers={})
    expected = {"http": f"POST http://{written}:80/hook HTTP/1.1", "https": f"CONNECT {written}:443 HTTP/1.0"}
    assert seen == [expected[scheme].encode()]


def test_no_proxy_naming_a_host_in_its_xn_form_holds_for_the_url_written_beyond_ascii(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with proxy_seeing(monkeypatch, "http") as seen:
        monkeypatch.setenv("NO_PROXY", "xn--bcher-kva.example")
        with pytest.raises(socket.gaierror):  # (straight to the host, which does not resolve here)
            post_json("http://bücher.example/hook", {"x": 1}, deadline=5, headers={})
    assert seen == []


@pytest.mark.parametrize("header", ["²", "1²", "soon"])
def test_a_retry_after_that_is_no_number_asks_for_nothing(receiver: Receiver, header: str) -> None:
    receiver.answers = [(429, {"Retry-After": header}), (200, {"Retry-After": header})]
    assert post_json(f"{receiver.url}/hook", {"x": 1}, deadline=5, headers={}).retry_after is None
    assert post_json(f"{receiver.url}/hook", {"x": 1}, deadline=5, headers={}).status == 200


def test_a_retry_after_is_read_on_a_429_or_a_503_only(receiver: Receiver) -> None:
    receiver.answers = [(status, {"Retry-After": "600"}) for status in (429, 503, 200, 404)]
    asked = [post_json(f"{receiver.url}/hook", {"x": 1}, deadline=5, headers={}).retry_after for _ in range(4)]
    assert asked == [600.0, 600.0, None, None]


def records(*addresses: tuple[int, str]) -> Any:
    """A resolver answering with these (family, address) records, on the port asked for."""

    def resolve(host: str, port: int, type: int = 0) -> list[tuple[Any, ...]]:  # noqa: A002 (getaddrinfo's name)
        return [(family, socket.SOCK_STREAM, 6, "", (address, port)) for family, address in addresses]

    return resolve


def test_the_peers_of_a_name_are_its_addresses_each_once_and_ipv4_when_it_has_some(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    v4, v6 = socket.AF_INET, socket.AF_INET6
    cluster = records((v4, "10.0.0.1"), (v6, "fd00::1"), (v4, "10.0.0.2"), (v4, "10.0.0.1"))
    assert peers("http://am.monitoring:9093", cluster) == ["10.0.0.1", "10.0.0.2"]
    assert peers("http://am.monitoring:9093", records((v6, "fd00::1"), (v6, "fd00::2"))) == ["fd00::1", "fd00::2"]
    assert peers("http://am:9093", records((v4, "10.0.0.1"), (v6, "fd00::1"))) == [None]  # (one peer: as it is)
    assert peers("http://10.0.0.9:9093", cluster) == [None]  # (an address)
    assert peers("http://[fd00::9]:9093", cluster) == [None]

    def refused(*args: object, **kwargs: object) -> list[Any]:
        raise socket.gaierror(socket.EAI_NONAME, "unknown")

    assert peers("http://am.monitoring:9093", refused) == [None]  # (the POST says why it fails)
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.example:3128")
    assert peers("http://am.monitoring:9093", cluster) == [None]  # (the proxy reaches the name)
