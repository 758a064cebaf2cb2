"""The errors of a billing call, one class per way it fails, all under `BillingError`: a caller
catches what it can act on (a refused signature is not an outage, a closed client is neither).
"""


class BillingError(Exception):
    """Anything that stops a billing call from giving a trustworthy answer."""


class BillingAPIError(BillingError):
    """The API answered with a non-zero `code` (or an HTTP error status)."""

    def __init__(self, summary: str, *, status: int, code: int | None, message: str) -> None:
        super().__init__(summary)
        self.status = status
        self.code = code
        self.message = message


class SignatureRejected(BillingAPIError):
    """The API refused our credentials or signature (wrong key, skewed clock, ...)."""


class BillingUnavailable(BillingError):
    """No usable answer after every retry: timeouts, connection errors, 429 or 5xx."""


class AskedToWait(BillingUnavailable):
    """The API asked not to be asked again for a while (a long Retry-After): the call was not made,
    or was answered only with that."""


class ClientClosed(BillingUnavailable):
    """The client was closed (a config reload replaced it) while a call was under way."""


class RecordError(BillingError):
    """A response or record that does not have the documented shape."""


def why(error: BillingError) -> str:
    """Why a call failed, in a few words (what a month left out of an export says)."""
    if isinstance(error, BillingUnavailable):
        return "the API could not be reached, or kept failing"
    if isinstance(error, RecordError):
        return "the API's answer was not as documented"
    return "the API refused it"
