"""The APIs in process, for the unit layer: the simulator's billing ledger and its chat answers without HTTP."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Generator, Iterator, Sequence
from contextlib import contextmanager
from http import HTTPStatus
from typing import Any, TypeVar
from urllib.parse import urlencode

from exporter.billing import BILLS_PATH, MAX_USAGE_PAGE_SIZE, USAGES_PATH, BillingAPI, Listings
from exporter.config.schema import InferenceConfig, ProbeConfig
from exporter.core.clock import Clock
from exporter.sim import Fault, Simulator
from exporter.sim.model import CONTENT_FAULTS, SimulatorError, _encode, corrupt
from exporter.sources.probe import ProbeRunner, Silence

R = TypeVar("R")


def _applied(fault: Fault) -> bool:
    """A fault the fake applies: one that changes what a listing says, or a refusal (a status the
    client takes as the answer, not retrying it)."""
    return fault.kind in CONTENT_FAULTS or (fault.kind == "status" and fault.status < 500 and fault.status != 429)


class FakeBilling(Listings):
    """A `BillingAPI` answering from `sim` in process.

    Each page is the simulator's own answer to the same query (`bills_response`, `usages_response`),
    in the envelope its HTTP side sends, read, parsed and checked by the client's own code
    (`Listings`, `parse_envelope`): records, totals, caps and API errors come out as over the wire.
    Requests are counted in `sim.requests_served` as the server counts them, so a test can count
    pages, and told to `on_response` as the client tells its own (the API and the HTTP status);
    `on_skew` hears the simulator's clock minus `clock` (the simulator's own unless given), to the
    second, as the client reads it from the `Date` header. Injected faults that change what a
    listing says (`bad_amount`, `bad_value`, `total_mismatch`) and refusals (a `status` fault of a
    4xx but 429) are applied as the server applies them; what belongs to the wire (signatures,
    retries, the other faults, latency, requests in parallel) is not here: those tests run over HTTP.
    """

    def __init__(
        self, sim: Simulator, *, page_size: int = MAX_USAGE_PAGE_SIZE, project_id: str = "",
        on_response: Callable[[str, str], None] | None = None, on_skew: Callable[[float], None] | None = None,
        clock: Clock | None = None,
    ) -> None:  # fmt: skip
        super().__init__(tz=sim.clock.tz, project_id=project_id, page_size=page_size)
        self.sim = sim
        self.base_url = "in-process://simulator"
        self._on_response = on_response or (lambda api, code: None)
        self._on_skew = on_skew or (lambda skew: None)
        self._clock = clock or sim.clock

    def close(self, cut: bool = True) -> None:
        """Nothing to release: no connections, no threads."""

    def carry_over(self, before: BillingAPI) -> None:
        """Nothing to take on: no `Retry-After` is answered in process (a wire fault)."""

    def _answer(self, api: str, path: str, params: dict[str, str | int]) -> tuple[int, bytes]:
        respond = {BILLS_PATH: self.sim.bills_response, USAGES_PATH: self.sim.usages_response}[path]
        with self.sim._lock:
            self.sim.requests_served[path] = self.sim.requests_served.get(path, 0) + 1
        fault = self._take_fault(path)
        self._on_skew(math.floor(self.sim.clock.now().timestamp()) - self._clock.now().timestamp())
        if fault is not None and fault.kind == "status":
            self._on_response(api, str(fault.status))
            envelope = {"code": 100500, "reason": "Fault", "message": HTTPStatus(fault.status).phrase}
            return fault.status, _encode(envelope)
        try:
            data = respond(urlencode(params))
        except SimulatorError as error:
            self._on_response(api, str(error.http_status))
            envelope = {"code": error.code, "reason": error.reason, "message": error.message}
            return error.http_status, _encode(envelope)
        self._on_response(api, "200")
        if fault is not None:
            data = corrupt(data, fault)
        return 200, _encode({"code": 0, "reason": "OK", "message": "success", "data": data})

    def _take_fault(self, path: str) -> Fault | None:
        """The next fault injected for `path` that the fake applies, taken as the server takes it."""
        with self.sim._lock:
            fault = next((f for f in self.sim._faults if path.startswith(f.path) and f.times > 0 and _applied(f)), None)
            if fault is not None:
                fault.times -= 1
                if fault.times == 0:
                    self.sim._faults.remove(fault)
        return fault

    def _one(self, fetch: Callable[[int], R], page_num: int) -> R:
        return fetch(page_num)

    def _many(self, fetch: Callable[[int], R], pages: range) -> Generator[tuple[int, R], None, None]:
        """The pages last first: a parallel read may deliver them in any order after the first, and
        over HTTP they come nearly in order, so the fake takes the order furthest from that. Every
        page is asked for before the first comes, as if all were in flight at once (over HTTP, up
        to `LOOKAHEAD` × `concurrency` are), so a page that fails to read stops none of the others
        from being asked for."""
        yield from reversed([(page_num, self._one(fetch, page_num)) for page_num in pages])


class Ticks:
    """A probe runner's clock in the unit layer: it moves only when an answer pauses, never by itself."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class InProcessChat:
    """The simulator's chat API in process, behind the probe's `ChatTransport`: its answers, faults
    and pauses as over HTTP (`Simulator.chat_exchange`), each pause passing on `clock`. A pause
    that outlasts the run's deadline ends the wait at the deadline, as a socket's timeout would:
    Silence, before the headers as in the body."""

    def __init__(self, sim: Simulator, clock: Ticks, api_key: str, cut: str = "as written") -> None:
        self.sim, self.clock, self.api_key, self.cut = sim, clock, api_key, cut

    def close(self) -> None:
        """Nothing to release: no connections."""

    @contextmanager
    def post(
        self, body: dict[str, Any], deadline: Callable[[], float]
    ) -> Iterator[tuple[int, Iterator[tuple[bytes, float]]]]:
        reply = self.sim.chat_exchange(json.dumps(body).encode(), f"Bearer {self.api_key}")
        if reply.events is None:
            self._wait(reply.wait, deadline)
            yield reply.status, self._arrivals([(0.0, reply.body)] if reply.body else [], deadline)
        else:
            yield reply.status, self._arrivals(reply.events, deadline)

    def _wait(self, pause: float, deadline: Callable[[], float]) -> None:
        limit = max(deadline() - self.clock.now, 0.0)
        if pause > limit:
            self.clock.now += limit
            raise Silence(self.clock.now)
        self.clock.now += pause

    def _arrivals(
        self, writes: Sequence[tuple[float, bytes]], deadline: Callable[[], float]
    ) -> Iterator[tuple[bytes, float]]:
        if self.cut == "coalesced":
            merged: list[tuple[float, bytes]] = []
            for pause, data in writes:
                if merged and not pause:
                    merged[-1] = (merged[-1][0], merged[-1][1] + data)
                else:
                    merged.append((pause, data))
            writes = merged
        for pause, data in writes:
            self._wait(pause, deadline)
            size = 7 if self.cut == "split" else len(data)
            for start in range(0, len(data), size):
                yield data[start : start + size], self.clock.now


def chat_runner(sim: Simulator, probe: ProbeConfig, inference: InferenceConfig) -> ProbeRunner:
    """A runner of `probe` whose requests `sim` answers in process, with the config's API key,
    timed on a clock of its own that moves only when an answer pauses."""
    ticks = Ticks()
    chat = InProcessChat(sim, ticks, inference.api_key.get_secret_value())
    return ProbeRunner(probe, inference, chat=chat, clock=ticks)
