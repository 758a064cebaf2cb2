"""Property tests: whatever comes in, the parsers raise only our own clear errors."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exporter.billing import BillingError, SignatureRejected, parse_bill, parse_envelope, parse_usage
from exporter.billing.signing import new_nonce, sign_request
from exporter.config.load import ConfigError, load, validate
from exporter.config.schema import Config
from exporter.core.clock import Clock, FrozenClock
from exporter.sim import Simulator
from exporter.sources.probe import Answer, ProbeFailure, apply_event, apply_response, sse_events
from tests.conftest import SHANGHAI

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20)
json_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=5),
    max_leaves=20,
)  # fmt: skip
config_keys = st.sampled_from(
    ["billing", "url", "access_key_id", "secret_access_key", "page_size", "timeout", "probes", "alerts", "rules",
     "notifiers", "budgets", "name", "type", "amount", "signal", "threshold", "tiers", "by", "where", "for"]
)  # fmt: skip
config_like = st.recursive(
    scalars | st.sampled_from(["5m", "${X}", "${file:/nonexistent}", "http://x", "spend", "webhook", "0.5"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(config_keys | st.text(max_size=8), inner, max_size=5),
    max_leaves=25,
)  # fmt: skip


@FUZZ
@given(config_like)
def test_config_validation_raises_only_config_errors(document: object) -> None:
    try:
        assert isinstance(validate(document, {"X": "x"}), Config)
    except ConfigError as error:
        assert error.details
        assert all(isinstance(detail, str) and detail for detail in error.details)


@FUZZ
@given(st.text(max_size=300))
def test_config_files_raise_only_config_errors(tmp_path_factory: object, text: str) -> None:
    path = Path(tmp_path_factory.mktemp("cfg")) / "config.yaml"  # type: ignore[attr-defined]
    path.write_text(text, encoding="utf-8")
    try:
        load(path, {})
    except ConfigError as error:
        assert error.details


@FUZZ
@given(st.integers(100, 599), st.binary(max_size=200) | json_values.map(lambda v: json.dumps(v).encode()))
def test_envelope_parser_raises_only_billing_errors(status: int, body: bytes) -> None:
    try:
        assert isinstance(parse_envelope(status, body, "GET /x"), dict)
        assert status not in (401, 403)  # (never data from a refusal)
    except BillingError as error:
        assert str(error).startswith("GET /x")
        assert isinstance(error, SignatureRejected) == (status in (401, 403))  # whatever the body


@pytest.mark.parametrize(
    "body",
    [b"<html>401 Unauthorized</html>", b"", b'{"error": "unauthorized"}', b'"no"', b'{"code": true}',
     b'{"code": 0, "reason": "OK", "message": "success", "data": {}}'],  # (a success envelope under a 401, too)
)  # fmt: skip
@pytest.mark.parametrize("status", [401, 403])
def test_a_401_or_403_is_a_refused_signature_whatever_its_body(status: int, body: bytes) -> None:
    """A gateway's or a proxy's page in place of the API's envelope: still a refused signature, which
    the client answers by signing with the server's clock."""
    with pytest.raises(SignatureRejected, match=f"^GET /x: signature rejected \\(HTTP {status}"):
        parse_envelope(status, body, "GET /x")


@FUZZ
@given(json_values)
def test_record_parsers_raise_only_record_errors(record: object) -> None:
    for parse in (lambda r: parse_bill(r, "bill 0", SHANGHAI), lambda r: parse_usage(r, "usage 0")):
        try:
            parse(record)
        except BillingError as error:
            assert str(error).split(":")[0] in ("bill 0", "usage 0")


@FUZZ
@given(st.lists(st.binary(max_size=40), max_size=10))
def test_sse_parser_never_fails(chunks: list[bytes]) -> None:
    events = list(sse_events(chunks))
    assert all(isinstance(event, str) for event in events)


@FUZZ
@given(st.lists(json_values.map(json.dumps) | st.text(max_size=40), max_size=6), json_values.map(json.dumps))
def test_stream_and_response_handling_raise_only_probe_failures(events: list[str], whole: str) -> None:
    answer = Answer()
    for event in events:
        try:
            apply_event(event, answer)
        except ProbeFailure as failure:
            assert failure.reason in ("invalid_json", "stream_error")
    try:
        apply_response(whole, Answer())
    except ProbeFailure as failure:
        assert failure.reason in ("invalid_json", "stream_error")


@FUZZ
@given(
    key_id=st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=30),
    query=st.text(st.characters(codec="ascii", exclude_characters="\n\r"), max_size=60),
    body=st.binary(max_size=100),
)
def test_any_signature_verifies_at_the_simulator(key_id: str, query: str, body: bytes) -> None:
    frozen = FrozenClock(dt.datetime(2026, 11, 22, 10, tzinfo=SHANGHAI))
    sim = Simulator(clock=Clock(SHANGHAI, frozen), access_key_id=key_id)
    created = int(frozen().timestamp())
    headers = sign_request(
        method="POST", query=query, path="/api/v1/x", body=body, key_id=key_id, secret=sim.secret_access_key,
        label="svc", created=created, expires=created + 300, nonce=new_nonce(),
    ).as_dict()  # fmt: skip
    sim.verify_signature("POST", query, "/api/v1/x", headers, body)
