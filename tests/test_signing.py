import base64
import json
import re

import pytest
import requests

from exporter.billing.signing import BillingSigner, quote, sign_request, signature_base, signature_params
from tests.conftest import DATA

VECTORS = json.loads((DATA / "signature-vectors.json").read_text())


@pytest.mark.parametrize("vector", VECTORS, ids=[f"{v['method']} {v['path'] or '/'}?{v['query']}" for v in VECTORS])
def test_signature_vectors_byte_for_byte(vector: dict) -> None:
    headers = sign_request(
        method=vector["method"],
        query=vector["query"],
        path=vector["path"],
        body=vector["body"].encode(),
        key_id=vector["access_key_id"],
        secret=vector["secret_access_key"],
        label=vector["label"],
        created=vector["created"],
        expires=vector["expires"],
        nonce=vector["nonce"],
    )
    expected = vector["expected"]
    assert headers.content_digest == expected["Content-Digest"]
    assert headers.signature_input == expected["Signature-Input"]
    assert headers.signature == expected["Signature"]
    params = signature_params(
        created=vector["created"], expires=vector["expires"], nonce=vector["nonce"], key_id=vector["access_key_id"]
    )
    base = signature_base(
        method=vector["method"],
        query=vector["query"],
        path=vector["path"],
        digest=headers.content_digest,
        params=params,
    )
    assert base == expected["signature_base"]


def test_quoting_escapes_backslash_and_double_quote() -> None:
    assert quote('a"b\\c') == '"a\\"b\\\\c"'


def _signed(signer: BillingSigner, url: str, **kwargs: object) -> requests.PreparedRequest:
    return signer(requests.Request("GET", url, **kwargs).prepare())


def test_signer_signs_the_query_exactly_as_sent() -> None:
    signer = BillingSigner("AK1", "secret", time_fn=lambda: 1763776800.0)
    params = {"period": "2026-11", "start_time": "2026-11-01T00:00:00+08:00", "page_num": 1}
    prepared = _signed(signer, "http://127.0.0.1/api/v1/bills/details", params=params)
    wire_query = prepared.url.split("?", 1)[1]
    assert wire_query == "period=2026-11&start_time=2026-11-01T00%3A00%3A00%2B08%3A00&page_num=1"
    nonce = re.search(r'nonce="([^"]+)"', prepared.headers["Signature-Input"])[1]
    again = sign_request(
        method="GET",
        query=wire_query,
        path="/api/v1/bills/details",
        body=b"",
        key_id="AK1",
        secret="secret",
        label="svc",
        created=1763776800,
        expires=1763777100,
        nonce=nonce,
    )
    assert prepared.headers["Signature"] == again.signature
    assert prepared.headers["Signature-Input"] == again.signature_input


def test_lifetime_zero_omits_expires_and_label_is_configurable() -> None:
    signer = BillingSigner("AK1", "secret", label="acct", lifetime=0, time_fn=lambda: 1000.0)
    headers = _signed(signer, "http://127.0.0.1/x").headers
    assert headers["Signature-Input"].startswith(
        'acct=("@method" "@query" "@path" "content-digest");created=1000;nonce='
    )
    assert "expires" not in headers["Signature-Input"]
    assert headers["Signature"].startswith("acct=:")
    with_lifetime = _signed(BillingSigner("AK1", "s", lifetime=60, time_fn=lambda: 1000.0), "http://h/x").headers
    assert ";created=1000;expires=1060;" in with_lifetime["Signature-Input"]


def test_nonce_is_32_random_bytes_base64url_unpadded_and_never_reused() -> None:
    signer = BillingSigner("AK1", "secret")
    nonces = set()
    for _ in range(5000):
        nonce = re.search(r'nonce="([^"]+)"', _signed(signer, "http://h/x").headers["Signature-Input"])[1]
        assert re.fullmatch(r"[A-Za-z0-9_-]{43}", nonce)
        assert len(base64.urlsafe_b64decode(nonce + "=")) == 32
        nonces.add(nonce)
    assert len(nonces) == 5000


def test_signer_repr_hides_the_secret() -> None:
    signer = BillingSigner("AK1", "very-secret-value")
    assert "very-secret-value" not in repr(signer)
    assert "AK1" in repr(signer)


def test_no_nonce_repeats_over_100k_signatures() -> None:
    signer = BillingSigner("AK1", "secret", time_fn=lambda: 1763776800.0)
    request = requests.Request("GET", "http://127.0.0.1/api/v1/usages/details?date=2026-11-22").prepare()
    seen = set()
    for _ in range(100_000):
        header = signer(request).headers["Signature-Input"]
        seen.add(header[header.index('nonce="') + 7 : header.index('";keyid')])
    assert len(seen) == 100_000


@pytest.mark.parametrize("vector", VECTORS, ids=[f"{v['method']} {v['path'] or '/'}?{v['query']}" for v in VECTORS])
def test_the_simulator_accepts_exactly_the_fixed_vectors(vector: dict) -> None:
    """The simulator's check against the vectors themselves, not against our signer: a bug the
    signer and the checker shared would still fail here."""
    import datetime as dt

    from exporter.core.clock import Clock
    from exporter.sim import Simulator
    from exporter.sim.model import SimulatorError

    created = dt.datetime.fromtimestamp(vector["created"], dt.UTC)
    sim = Simulator(
        clock=Clock(now_fn=lambda: created),
        access_key_id=vector["access_key_id"],
        secret_access_key=vector["secret_access_key"],
        label=vector["label"],
    )
    expected = vector["expected"]
    headers = {name: expected[name] for name in ("Content-Digest", "Signature-Input", "Signature")}
    body = vector["body"].encode()
    sim.verify_signature(vector["method"], vector["query"], vector["path"] or "/", headers, body)
    forged = headers | {
        "Signature": expected["Signature"].replace(
            expected["Signature"][5], "A" if expected["Signature"][5] != "A" else "B", 1
        )
    }
    with pytest.raises(SimulatorError):
        sim.verify_signature(vector["method"], vector["query"], vector["path"] or "/", forged, body + b"")
