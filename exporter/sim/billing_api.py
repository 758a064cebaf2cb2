"""The billing API's side of the simulator: signature checks, query parameters, pages."""

from __future__ import annotations

import datetime as dt
import hmac
import re
from typing import Any
from urllib.parse import parse_qsl

from exporter.billing.signing import content_digest, sign, signature_base
from exporter.sim.ledger import Ledger
from exporter.sim.model import (
    BILLS_QUERY,
    MAX_PAGE_SIZE,
    SIGNATURE_WINDOW,
    USAGES_QUERY,
    SimulatorError,
    UsageDay,
    _RawList,
)


class BillingService(Ledger):
    """The billing API's answers (a part of `Simulator`)."""

    # -- billing API ----------------------------------------------------------------------

    def verify_signature(self, method: str, raw_query: str, path: str, headers: Any, body: bytes) -> None:
        def reject(reason: str, message: str) -> SimulatorError:
            return SimulatorError(401, 100401, reason, message)

        digest = headers.get("Content-Digest")
        signature_input = headers.get("Signature-Input")
        signature = headers.get("Signature")
        if not (digest and signature_input and signature):
            raise reject("SignatureMissing", "Content-Digest, Signature-Input and Signature are required")
        if not hmac.compare_digest(digest, content_digest(body)):
            raise reject("DigestMismatch", "Content-Digest does not match the body")
        label, _, params = signature_input.partition("=")
        if label != self.label or not signature.startswith(f"{self.label}=:") or not signature.endswith(":"):
            raise reject("SignatureLabel", f"signature label must be {self.label!r}")
        match = re.fullmatch(
            r'\("@method" "@query" "@path" "content-digest"\);created=(\d+)(?:;expires=(\d+))?'
            r';nonce="([A-Za-z0-9_-]{43})";keyid="((?:[^"\\]|\\.)*)";alg="hmac-sha256"',
            params,
        )
        if not match:
            raise reject("SignatureInput", "Signature-Input parameters are malformed or out of order")
        created, expires = int(match[1]), int(match[2]) if match[2] else None
        nonce, key_id = match[3], re.sub(r"\\(.)", r"\1", match[4])
        now = self.clock.now().timestamp()
        if abs(now - created) > SIGNATURE_WINDOW:
            raise reject("SignatureExpired", "created is outside the accepted clock window")
        if expires is not None and (expires <= created or now > expires):
            raise reject("SignatureExpired", "signature has expired")
        if key_id != self.access_key_id:
            raise reject("AccessKeyInvalid", "unknown access key")
        base = signature_base(method=method, query=raw_query, path=path, digest=digest, params=params)
        expected = f"{self.label}=:{sign(self.secret_access_key, base)}:"
        if not hmac.compare_digest(signature, expected):
            raise reject("SignatureMismatch", "signature does not match")
        with self._lock:
            while self._nonce_expiry and self._nonce_expiry[0][0] < now:
                self._nonces.pop(self._nonce_expiry.popleft()[1], None)
            if nonce in self._nonces:
                raise reject("NonceReused", "nonce has been used before")
            self._nonces[nonce] = now
            self._nonce_expiry.append((now + 2 * SIGNATURE_WINDOW, nonce))

    @staticmethod
    def _query(raw_query: str, allowed: set[str]) -> dict[str, str]:
        params: dict[str, str] = {}
        for name, value in parse_qsl(raw_query, keep_blank_values=True, strict_parsing=bool(raw_query)):
            if name != name.lower():
                raise SimulatorError(400, 100400, "InvalidParameter", f"parameter {name!r} must be snake_case")
            if name not in allowed:
                raise SimulatorError(400, 100400, "InvalidParameter", f"unknown parameter {name!r}")
            params[name] = value
        return params

    @staticmethod
    def _paging(params: dict[str, str], default_size: int) -> tuple[int, int]:
        try:
            page_num = int(params.get("page_num", "1"))
            page_size = int(params.get("page_size", str(default_size)))
        except ValueError:
            raise SimulatorError(400, 100400, "InvalidParameter", "page_num and page_size must be integers") from None
        if page_num < 1 or not 1 <= page_size <= MAX_PAGE_SIZE:
            raise SimulatorError(400, 100400, "InvalidParameter", f"page_num ≥ 1 and page_size 1..{MAX_PAGE_SIZE}")
        return page_num, page_size

    def bills_response(self, raw_query: str) -> dict[str, Any]:
        params = self._query(raw_query, BILLS_QUERY)
        period = params.get("period", "")
        if not re.fullmatch(r"\d{4}-(0[1-9]|1[0-2])", period):
            raise SimulatorError(400, 100400, "InvalidParameter", "period must be YYYY-MM")
        if params.get("group_period") != "GROUP_PERIOD_DAILY":
            raise SimulatorError(400, 100400, "InvalidParameter", "group_period must be GROUP_PERIOD_DAILY")
        group_term = params.get("group_term", "GROUP_TERM_ITEM")
        if group_term not in ("GROUP_TERM_ITEM", "GROUP_TERM_INSTANCE"):
            raise SimulatorError(400, 100400, "InvalidParameter", "unknown group_term")
        page_num, page_size = self._paging(params, 20)
        if self.before_bills_page is not None:
            self.before_bills_page(page_num)
        rows = self.bill_rows(period, group_term, params.get("project_id", ""), params.get("instance_id", ""))
        start = (page_num - 1) * page_size
        return {"list": rows[start : start + page_size], "total": len(rows)}

    def usages_response(self, raw_query: str) -> dict[str, Any]:
        params = self._query(raw_query, USAGES_QUERY)
        try:
            day = dt.date.fromisoformat(params.get("date", ""))
        except ValueError:
            raise SimulatorError(400, 100400, "InvalidParameter", "date must be YYYY-MM-DD") from None
        if day > self.clock.today():
            raise SimulatorError(400, 100400, "InvalidParameter", "date must not be in the future")
        page_num, page_size = self._paging(params, 100)
        if self.usage_page_cap is not None:
            page_size = min(page_size, self.usage_page_cap)
        if self.before_usage_page is not None:
            self.before_usage_page(page_num)
        start = (page_num - 1) * page_size
        project, model = params.get("project_id"), params.get("model")
        with self._lock:
            indices = self._usage.get(day, UsageDay()).indices()
            indices = indices[start : start + page_size] if not (project or model) else list(indices)
            total = len(self._usage.get(day, UsageDay()).indices())
        if not (project or model):
            page = _RawList(self.usage_record_json(day, i) for i in indices)
            return {"list": page, "total": total if self.total_as_number else str(total), "date": day.isoformat()}
        ids = {e.endpoint_id for e in self.endpoints if not project or e.project_id == project}
        records = (self.usage_record(day, i) for i in indices)
        matching = [r for r in records if r["endpoint"] in ids and (not model or r["model"] == model)]
        count = len(matching)
        return {
            "list": matching[start : start + page_size],
            "total": count if self.total_as_number else str(count),
            "date": day.isoformat(),
        }
