"""The billing API as the sources see it: the `BillingAPI` protocol and the paging every way of
answering shares (`api`), its records and their parsing (`records`), its errors (`errors`), the
signed HTTP client with its retries (`client`), and the request signature (`signing`).
"""

from exporter.billing.api import (
    BILLS_PATH,
    GROUP_TERM_INSTANCE,
    GROUP_TERM_ITEM,
    MAX_USAGE_PAGE_SIZE,
    USAGES_PATH,
    BillingAPI,
    Listings,
)
from exporter.billing.client import BillingClient, RetryPolicy
from exporter.billing.errors import (
    AskedToWait,
    BillingAPIError,
    BillingError,
    BillingUnavailable,
    ClientClosed,
    RecordError,
    SignatureRejected,
    why,
)
from exporter.billing.records import BillRecord, UsagePage, UsageRecord, parse_bill, parse_envelope, parse_usage

__all__ = [
    "BILLS_PATH",
    "GROUP_TERM_INSTANCE",
    "GROUP_TERM_ITEM",
    "MAX_USAGE_PAGE_SIZE",
    "USAGES_PATH",
    "AskedToWait",
    "BillRecord",
    "BillingAPI",
    "BillingAPIError",
    "BillingClient",
    "BillingError",
    "BillingUnavailable",
    "ClientClosed",
    "Listings",
    "RecordError",
    "RetryPolicy",
    "SignatureRejected",
    "UsagePage",
    "UsageRecord",
    "parse_bill",
    "parse_envelope",
    "parse_usage",
    "why",
]
