"""Host name lookups end with the exchange's deadline (`core.lookup`): a resolver that does not
answer held a probe run, a billing request, a POST or an SMTP session for as long as it hung, past
every deadline, and held a reload's replacement probe back behind the run it replaced.

The resolver is the one thing faked here (a name under `.hang.test` never answers until the test
ends, one under `.loop.test` is 127.0.0.1): the servers are real, on loopback."""

from __future__ import annotations

import datetime as dt
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

import pytest
import requests

from exporter.billing.client import BillingClient, RetryPolicy
from exporter.billing.errors import BillingUnavailable, ClientClosed
from exporter.billing.signing import BillingSigner
from exporter.core import lookup
from exporter.core.deadline import Deadline
from exporter.core.post import DeadlineExceeded, peers, post_json
from exporter.core.watched import WatchedAdapter
from exporter.notifiers import smtp
from exporter.notifiers.email import EmailNotifier
from exporter.sim import Simulator, SimulatorServer
from tests.helpers import wait_for
from tests.smtp import Mailbox, Start
from tests.test_probe import assert_failed_once
from tests.test_probe_http import runner, runner_for

pytestmark = pytest.mark.integration


class Resolver:
    """`socket.getaddrinfo`, with a name under `.hang.test` that hangs until `release` and one
    under `.loop.test` that is 127.0.0.1; how many lookups of each name were made."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.looked_up: dict[str, int] = {}
        self._real = socket.getaddrinfo

    def __call__(self, host: str, port: object, *args: object, **kwargs: object) -> list:
        if host.endswith((".hang.test", ".loop.test")):
            self.looked_up[host] = self.looked_up.get(host, 0) + 1
        if host.endswith(".hang.test"):
            self.release.wait()
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        if host.endswith(".loop.test"):
            host = "127.0.0.1"
        return self._real(host, port, *args, **kwargs)  # type: ignore[arg-type]


@pytest.fixture
def resolver(monkeypatch: pytest.MonkeyPatch) -> Iterator[Resolver]:
    made = Resolver()
    monkeypatch.setattr(socket, "getaddrinfo", made)
    monkeypatch.setattr(lookup, "_lookups", {})  # (no answer of another test's kept)
    yield made
    made.release.set()  # (the lookups still hanging end, here: not in the next test's tables)
    wait_for(lambda: not lookup.under_way())


def test_a_lookup_that_hangs_is_given_up_at_the_time_left_and_made_once_for_every_waiter(resolver: Resolver) -> None:
    failed: list[BaseException] = []

    def look() -> None:
        try:
            lookup.getaddrinfo("api.hang.test", 443, lookup.within(0.3))
        except BaseException as error:
            failed.append(error)

    threads = [threading.Thread(target=look) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert [type(error) for error in failed] == [lookup.LookupTimeout] * 3
    assert resolver.looked_up == {"api.hang.test": 1}  # (the one lookup, still under way)


def test_a_lookup_slower_than_every_deadline_is_kept_for_the_next_exchange(
    resolver: Resolver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A resolver that answers after each exchange has given up: its answer, thrown away, left every
    exchange failing, each starting the lookup again."""
    answered = threading.Event()

    def slow(host: str, port: object, *args: object, **kwargs: object) -> list:
        time.sleep(0.5)
        answered.set()
        return resolver("api.loop.test", port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", slow)
    with pytest.raises(lookup.LookupTimeout):
        lookup.getaddrinfo("api.slow.test", 443, lookup.within(0.1))
    assert answered.wait(10)
    wait_for(lambda: not lookup.under_way())  # (the lookup has ended: nobody waits for it)
    found = lookup.getaddrinfo("api.slow.test", 443, lookup.within(0.1))
    assert {info[4][0] for info in found} == {"127.0.0.1"}
    assert resolver.looked_up == {"api.loop.test": 1}


def test_a_lookup_whose_thread_cannot_start_fails_and_leaves_nothing_under_way(
    resolver: Resolver, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refused(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    with monkeypatch.context() as patched:
        patched.setattr(threading.Thread, "start", refused)
        with pytest.raises(OSError, match="could not start"):
            lookup.getaddrinfo("api.loop.test", 443, lookup.within(1))
    assert lookup.under_way() == []
    assert {info[4][0] for info in lookup.getaddrinfo("api.loop.test", 443, lookup.within(10))} == {"127.0.0.1"}


def test_a_deadline_fired_ends_the_wait_for_a_lookup_at_once(resolver: Resolver) -> None:
    deadline = Deadline(3600)
    threading.Timer(0.2, deadline.fire).start()
    with pytest.raises(lookup.LookupTimeout):
        lookup.getaddrinfo("api.hang.test", 443, lookup.within(deadlines=[deadline]))


def test_a_probe_whose_host_name_does_not_resolve_in_time_fails_to_connect_by_its_deadline(resolver: Resolver) -> None:
    snapshot = runner_for("http://api.hang.test:9", timeout="500ms").run()
    assert_failed_once(snapshot, "timeout_connect")


def test_a_probe_closed_while_its_host_name_is_looked_up_ends_at_once(resolver: Resolver) -> None:
    """A reload replaced the probe: the run it replaced must not hold the source's lock until the
    lookup ends (the replacement's runs would be skipped meanwhile)."""
    probe = runner_for("http://api.hang.test:9", timeout="1h")
    threading.Timer(0.3, probe.close).start()
    with pytest.raises(ClientClosed):
        probe.run()


def test_a_probe_reaches_a_name_that_resolves_at_its_address(
    resolver: Resolver, sim: Simulator, server: SimulatorServer
) -> None:
    port = server.url.rsplit(":", 1)[1]
    last = runner(sim, server, url=f"http://sim.loop.test:{port}").run().last
    assert (last.success, last.reason) == (True, None)
    assert resolver.looked_up == {"sim.loop.test": 1}


def test_a_billing_request_whose_host_name_hangs_is_unavailable_by_its_timeout(resolver: Resolver) -> None:
    client = BillingClient(
        "http://billing.hang.test:9",
        BillingSigner("AK1", "secret"),
        tz=dt.UTC,
        timeout=0.5,
        retry=RetryPolicy(attempts=2, backoff=0.01),
    )
    with client, pytest.raises(BillingUnavailable, match="timed out"):
        client.bills("2026-11", "ITEM")


class _Accepting(BaseHTTPRequestHandler):
    hosts: ClassVar[list[str]] = []
    """The `Host` of each request, in turn."""

    def do_GET(self) -> None:
        self.hosts.append(self.headers["Host"])
        self.send_response(204)
        self.end_headers()

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.do_GET()

    def log_message(self, *args: object) -> None:
        pass


def test_a_post_whose_host_name_hangs_ends_at_its_deadline_and_one_that_resolves_is_posted(resolver: Resolver) -> None:
    with pytest.raises(DeadlineExceeded):
        post_json("http://hook.hang.test:9/x", {}, deadline=0.5, headers={})
    assert peers("http://am.hang.test:9093", within=0.2) == [None]  # (the POST says why it fails)
    receiver = ThreadingHTTPServer(("127.0.0.1", 0), _Accepting)
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    try:
        answer = post_json(f"http://hook.loop.test:{receiver.server_port}/x", {}, deadline=10, headers={})
        assert answer.status == 204
        assert _Accepting.hosts[-1] == f"hook.loop.test:{receiver.server_port}"  # (told as itself, not its address)
    finally:
        receiver.shutdown()
        receiver.server_close()


def test_a_connection_made_to_a_names_address_is_told_the_name(resolver: Resolver) -> None:
    """urllib3's connections (the billing client's, the probe's) connect to the address the
    lookup gave, and send the host's name: the `Host` header, and TLS's server name (its
    certificate checked against it: tests/test_probe_http.py's TLS runs)."""
    receiver = ThreadingHTTPServer(("127.0.0.1", 0), _Accepting)
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    session = requests.Session()
    session.mount("http://", WatchedAdapter())
    try:
        url = f"http://api.loop.test:{receiver.server_port}/"
        for _ in range(2):  # (the second on the connection kept alive)
            assert session.get(url, timeout=10).status_code == 204
        assert _Accepting.hosts[-2:] == [f"api.loop.test:{receiver.server_port}"] * 2
        assert resolver.looked_up == {"api.loop.test": 1}
    finally:
        session.close()
        receiver.shutdown()
        receiver.server_close()


def test_an_email_whose_server_name_hangs_ends_at_its_deadline(resolver: Resolver) -> None:
    notifier = EmailNotifier.model_validate(
        {
            "name": "mail",
            "type": "email",
            "smtp": "mail.hang.test:2525",
            "from": "a@example.com",
            "to": ["b@example.com"],
        }
    )
    sent = smtp.send(notifier, "s", "t", "<p>h</p>", message_id="<a@b>", deadline=0.5)
    assert sent.reason is not None
    assert "deadline" in sent.reason


def test_an_email_goes_out_while_this_machines_name_takes_longer_than_its_deadline_to_look_up(
    monkeypatch: pytest.MonkeyPatch, start_smtp: Start, mailbox: Mailbox
) -> None:
    """The reverse lookup of the name EHLO gives took 3 s, the exchange's deadline 1 s: every
    email failed, each starting the lookup again. The first goes with the host name as it is set,
    the lookup ends in its thread and is kept, and the others give it."""
    looked_up = threading.Event()

    def slow() -> str:
        time.sleep(1.5)
        looked_up.set()
        return "mail-client.example"

    monkeypatch.setattr(socket, "getfqdn", slow)
    monkeypatch.setattr(lookup, "_lookups", {})  # (an answer of another test's: none)
    server = start_smtp(tls=None)
    notifier = EmailNotifier.model_validate(
        {"name": "mail", "type": "email", "smtp": f"127.0.0.1:{server.port}", "from": "a@example.com",
         "to": ["b@example.com"], "starttls": False}
    )  # fmt: skip
    first = smtp.send(notifier, "s", "t", "<p>h</p>", message_id="<1@x>", deadline=1.0)
    assert first.reason is None
    assert looked_up.wait(10)
    second = smtp.send(notifier, "s", "t", "<p>h</p>", message_id="<2@x>", deadline=1.0)
    assert second.reason is None
    assert len(mailbox.messages) == 2
    assert mailbox.names[0] != "mail-client.example"  # (the first did not wait for it)
    assert mailbox.names[1] == "mail-client.example"  # (kept, and given)


def test_a_failed_lookup_is_asked_again_at_the_next_try(resolver: Resolver, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure kept 30 s failed every retry of the billing client (four within seconds) for a
    resolver that failed once (EAI_AGAIN); and raised the one exception to each, its traceback
    growing."""
    failures = [socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")]

    def once(host: str, port: object, *args: object, **kwargs: object) -> list:
        if failures:
            raise failures.pop()
        return resolver("api.loop.test", port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", once)
    with pytest.raises(socket.gaierror):
        lookup.getaddrinfo("api.flaky.test", 443, lookup.within(5))
    assert {info[4][0] for info in lookup.getaddrinfo("api.flaky.test", 443, lookup.within(5))} == {"127.0.0.1"}


def test_a_failed_lookup_is_raised_afresh_to_each_of_its_waiters(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two callers wait for one lookup, which fails: each raises an exception of its own (the one
    exception raised in turn to each kept every waiter's frames in its traceback)."""
    waiters: set[int] = set()
    fail = threading.Event()
    real_wait = lookup.wait

    def waited(*args: Any, **kwargs: Any) -> Any:
        waiters.add(threading.get_ident())
        return real_wait(*args, **kwargs)

    def failing(*args: object, **kwargs: object) -> list:
        fail.wait(10)
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

    monkeypatch.setattr(socket, "getaddrinfo", failing)
    monkeypatch.setattr(lookup, "_lookups", {})
    monkeypatch.setattr(lookup, "wait", waited)
    raised: list[BaseException] = []

    def look() -> None:
        try:
            lookup.getaddrinfo("api.twice.test", 443, lookup.within(5))
        except socket.gaierror as error:
            raised.append(error)

    callers = [threading.Thread(target=look) for _ in range(2)]
    for caller in callers:
        caller.start()
    wait_for(lambda: len(waiters) == 2)  # (both wait for the one lookup)
    assert len(lookup._lookups) == 1
    fail.set()
    for caller in callers:
        caller.join(10)
    assert len(raised) == 2
    assert raised[0] is not raised[1]
