"""Request signing for the billing API (HTTP message signatures with HMAC-SHA256).

The signature covers the method, the raw query string as sent on the wire, the path and a
SHA-256 digest of the body. Every request gets a fresh 32-byte nonce.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import requests

COVERED_COMPONENTS = '("@method" "@query" "@path" "content-digest")'
ALGORITHM = "hmac-sha256"
NONCE_BYTES = 32


def b64url(data: bytes, *, pad: bool) -> str:
    encoded = base64.urlsafe_b64encode(data).decode("ascii")
    return encoded if pad else encoded.rstrip("=")


def content_digest(body: bytes) -> str:
    return "sha-256=" + b64url(hashlib.sha256(body).digest(), pad=True)


def quote(value: str) -> str:
    """A quoted parameter value: backslash and double quote escaped with a backslash."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def new_nonce() -> str:
    return b64url(secrets.token_bytes(NONCE_BYTES), pad=False)


def signature_params(*, created: int, expires: int | None, nonce: str, key_id: str) -> str:
    params = [COVERED_COMPONENTS, f"created={created}"]
    if expires is not None:
        params.append(f"expires={expires}")
    params += [f"nonce={quote(nonce)}", f"keyid={quote(key_id)}", f"alg={quote(ALGORITHM)}"]
    return ";".join(params)


def signature_base(*, method: str, query: str, path: str, digest: str, params: str) -> str:
    return "\n".join(
        [
            f'"@method": {method.upper()}',
            f'"@query": ?{query}',
            f'"@path": {path or "/"}',
            f'"content-digest": {digest}',
            f'"@signature-params": {params}',
        ]
    )


def sign(secret: str, base: str) -> str:
    mac = hmac.new(secret.encode("utf-8"), base.encode("utf-8"), hashlib.sha256)
    return b64url(mac.digest(), pad=False)


@dataclass(frozen=True)
class SignedHeaders:
    content_digest: str
    signature_input: str
    signature: str

    def as_dict(self) -> dict[str, str]:
        return {
            "Content-Digest": self.content_digest,
            "Signature-Input": self.signature_input,
            "Signature": self.signature,
        }


def sign_request(
    *,
    method: str,
    query: str,
    path: str,
    body: bytes,
    key_id: str,
    secret: str,
    label: str,
    created: int,
    expires: int | None,
    nonce: str,
) -> SignedHeaders:
    digest = content_digest(body)
    params = signature_params(created=created, expires=expires, nonce=nonce, key_id=key_id)
    base = signature_base(method=method, query=query, path=path, digest=digest, params=params)
    return SignedHeaders(
        content_digest=digest,
        signature_input=f"{label}={params}",
        signature=f"{label}=:{sign(secret, base)}:",
    )


class BillingSigner(requests.auth.AuthBase):
    """Signs each prepared request; a retried request is prepared, and so signed, anew.

    `clock_offset` (seconds) is added to the local time, so a caller that learned the server's
    clock can sign with the corrected time.
    """

    def __init__(
        self,
        access_key_id: str,
        secret_access_key: str,
        *,
        label: str = "svc",
        lifetime: int = 300,
        time_fn: Callable[[], float] = time.time,
    ) -> None:
        self._key_id = access_key_id
        self._secret = secret_access_key
        self._label = label
        self._lifetime = lifetime
        self._time = time_fn
        self.clock_offset = 0.0

    def __repr__(self) -> str:
        return f"BillingSigner(keyid={self._key_id!r}, label={self._label!r})"

    def local_time(self) -> float:
        """Our clock, before any correction."""
        return self._time()

    def created(self) -> int:
        """The signature's `created` for a request signed now: the corrected time, in whole seconds."""
        return int(self._time() + self.clock_offset)

    def __call__(self, request: requests.PreparedRequest) -> requests.PreparedRequest:
        url = urlsplit(request.url or "")
        body = request.body or b""
        if isinstance(body, str):
            body = body.encode("utf-8")
        created = self.created()
        headers = sign_request(
            method=request.method or "GET",
            query=url.query,
            path=url.path,
            body=body,
            key_id=self._key_id,
            secret=self._secret,
            label=self._label,
            created=created,
            expires=created + self._lifetime if self._lifetime > 0 else None,
            nonce=new_nonce(),
        )
        request.headers.update(headers.as_dict())
        return request
