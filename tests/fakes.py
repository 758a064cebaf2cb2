"""The billing API in process, for the unit layer: the simulator's ledger without HTTP."""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any, TypeVar
from urllib.parse import urlencode

from exporter.billing import BILLS_PATH, MAX_USAGE_PAGE_SIZE, USAGES_PATH, Listings, parse_envelope
from exporter.sim import Simulator
from exporter.sim.model import CONTENT_FAULTS, SimulatorError, _encode, corrupt

R = TypeVar("R")


class FakeBilling(Listings):
    """A `BillingAPI` answering from `sim` in process.

    Each page is the simulator's own answer to the same query (`bills_response`, `usages_response`),
    in the envelope its HTTP side sends, read, parsed and checked by the client's own code
    (`Listings`, `parse_envelope`): records, totals, caps and API errors come out as over the wire.
    Requests are counted in `sim.requests_served` as the server counts them, so a test can count
    pages. Injected faults that change what a listing says (`bad_amount`, `bad_value`,
    `total_mismatch`) are applied as the server applies them; what belongs to the wire (signatures,
    retries, the other faults, latency, requests in parallel) is not here: those tests run over HTTP.
    """

    def __init__(self, sim: Simulator, *, page_size: int = MAX_USAGE_PAGE_SIZE, project_id: str = "") -> None:
        super().__init__(tz=sim.clock.tz, project_id=project_id, page_size=page_size)
        self.sim = sim
        self.base_url = "in-process://simulator"

    def close(self) -> None:
        """Nothing to release: no connections, no threads."""

    def _get(self, api: str, path: str, params: dict[str, str | int]) -> dict[str, Any]:
        respond = {BILLS_PATH: self.sim.bills_response, USAGES_PATH: self.sim.usages_response}[path]
        with self.sim._lock:
            self.sim.requests_served[path] = self.sim.requests_served.get(path, 0) + 1
        try:
            data = respond(urlencode(params))
            fault = self.sim._take_fault(path, CONTENT_FAULTS)
            if fault is not None:
                data = corrupt(data, fault)
        except SimulatorError as error:
            envelope = {"code": error.code, "reason": error.reason, "message": error.message}
            return parse_envelope(error.http_status, _encode(envelope), f"GET {self.base_url}{path}")
        envelope = {"code": 0, "reason": "OK", "message": "success", "data": data}
        return parse_envelope(200, _encode(envelope), f"GET {self.base_url}{path}")

    def _one(self, fetch: Callable[[int], R], page_num: int) -> R:
        return fetch(page_num)

    def _many(self, fetch: Callable[[int], R], pages: range) -> Generator[tuple[int, R], None, None]:
        """The pages last first: a parallel read may deliver them in any order after the first, and
        over HTTP they come nearly in order, so the fake takes the order furthest from that."""
        yield from reversed([(page_num, self._one(fetch, page_num)) for page_num in pages])
