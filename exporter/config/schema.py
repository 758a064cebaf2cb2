"""The config's schema: typed, validated, frozen models (`exporter.core.typed`), and what each key may hold.

Loading a file (YAML, `${VAR}` and `${file:PATH}`, messages, warnings, checks across sections)
is `exporter.config.load`'s. The secrets are the `SecretStr` fields: `secret_fields` finds them in a
document, `Config.secret_values` in a loaded config.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Sequence
from decimal import Decimal
from types import UnionType
from typing import TYPE_CHECKING, Annotated, Any, Literal, Union, get_args, get_origin
from urllib.parse import urlsplit
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from exporter.config.rules import RuleConfig, rule_ids
from exporter.core.fields import (
    Amount,
    Duration,
    HttpUrl,
    Interval,
    Name,
    ScopeValue,
    Strict,
    Text,
    in_scope,
    parse_amount,
    scope_values,
)
from exporter.core.lognames import FORMATS, LEVELS
from exporter.core.typed import (
    AfterValidator,
    BeforeValidator,
    Field,
    Model,
    SecretStr,
    Tag,
    field_validator,
    model_validator,
)
from exporter.notifiers.kind import NotifierModel
from exporter.notifiers.registry import KINDS


def _regex(pattern: str) -> str:
    try:
        re.compile(pattern)
    except re.error as error:
        raise ValueError(f"not a valid regular expression ({error})") from None
    except (OverflowError, RecursionError):  # (a repeat count past what re takes; groups nested too deep)
        raise ValueError("not a regular expression Python can compile (too large, or nested too deep)") from None
    return pattern


def _billing_base(url: str) -> str:
    """The address the API's paths go after: a query or a fragment would end up before them, and a
    user name or password would be shown wherever the address is (in an error, a log line), while
    the billing API takes only its signature. Refused, naming only the part, never its value."""
    if parts := _parts_beyond_base(url):
        raise ValueError(f"has {parts}: give the base address alone (the API takes the access key's signature)")
    return url


def _parts_beyond_base(url: str) -> str | None:
    """What `url` has that a base address must not: a user name or password, a query or a fragment
    (an empty one too: the paths would go after its `?` or `#`), named without its value."""
    parts = urlsplit(url)
    if parts.username is not None or parts.password is not None:
        return "a user name or password"
    before_fragment, fragment, _ = url.partition("#")
    if "?" in before_fragment:
        return "a query"
    return "a fragment" if fragment else None


def _header_value(value: SecretStr) -> SecretStr:
    """A secret that goes into an HTTP header: printable Latin-1 (a line break inside, or a curly
    quote pasted in, cannot be sent, and the error would quote it). The value is never told."""
    if any(not (" " <= c <= "~" or "\xa0" <= c <= "\xff") for c in value.get_secret_value()):
        raise ValueError(
            "must be printable text an HTTP header can carry: no line break or control character inside,"
            " no character outside Latin-1 (a curly quote pasted in)"
        )
    return value


def _header_id(value: str) -> str:
    """An id that goes into a signed header: printable ASCII (the signature is of its UTF-8, the
    header is sent as Latin-1: beyond ASCII they differ, and a server checking the bytes refuses)."""
    if any(not " " <= c <= "~" for c in value):
        raise ValueError("must be printable ASCII text (it goes into the request's signed header)")
    return value


class BillingConfig(Strict):
    url: Annotated[HttpUrl, AfterValidator(_billing_base)]
    access_key_id: Annotated[Text, AfterValidator(_header_id)]
    secret_access_key: SecretStr
    signature_label: Annotated[str, Field(pattern=r"^[a-z][a-z0-9_-]*$")] = "svc"
    signature_lifetime: Duration = 300.0
    timezone: str = "Asia/Shanghai"
    project_id: str = ""
    bills_interval: Interval = 900.0
    usage_interval: Interval = 300.0
    page_size: Annotated[int, Field(ge=1, le=500)] = 500
    concurrency: Annotated[int, Field(ge=1, le=32)] = 4
    timeout: Interval = 30.0
    previous_month_grace_days: Annotated[int, Field(ge=0, le=27)] = 3
    history_months: Annotated[int, Field(ge=0, le=24)] = 3
    """Past months of daily bills kept for anomaly baselines, the month-start forecast and backtests."""
    per_api_key: bool = False
    currency: str = ""
    """The account's currency (ISO 4217, `CNY`), shown beside amounts; the API does not say it, so
    empty (unknown) unless given."""

    @field_validator("secret_access_key")
    @classmethod
    def _secret_present(cls, value: SecretStr) -> SecretStr:
        if not value.get_secret_value():
            raise ValueError("must not be empty")
        return value

    @field_validator("timezone")
    @classmethod
    def _known_zone(cls, value: str) -> str:
        try:
            ZoneInfo(value)
        except (ZoneInfoNotFoundError, ValueError, OSError):  # (OSError: a name too long for a file's)
            raise ValueError(f"unknown time zone {value[:80]!r}") from None
        return value

    @field_validator("currency")
    @classmethod
    def _currency_code(cls, value: str) -> str:
        if value and not re.fullmatch(r"[A-Z]{3}", value):
            raise ValueError(f"{value!r} is not an ISO 4217 currency code (three upper-case letters, e.g. CNY or USD)")
        return value

    @property
    def zone(self) -> ZoneInfo:
        return ZoneInfo(self.timezone)


def _inference_base(url: str) -> str:
    """The address the spec's paths (`/v1/chat/completions`) go after: OpenAI-style SDKs take it with
    `/v1` on the end, so that is taken off (the trailing `/` is already gone). A query or a fragment
    would end up before the path, and a user name or password would replace the API key with basic
    auth: refused, naming only the part, never its value."""
    if parts := _parts_beyond_base(url):
        raise ValueError(f"has {parts}: give the base address alone (the API key goes in `api_key`)")
    return url.removesuffix("/v1") if urlsplit(url).path.endswith("/v1") else url


class InferenceConfig(Strict):
    url: Annotated[HttpUrl, AfterValidator(_inference_base)]
    """The inference API's base address, without `/v1` whether or not it was written with it."""
    api_key: Annotated[SecretStr, AfterValidator(_header_value)]


class ProbeConfig(Strict):
    name: Name
    model: Text
    scenario: Literal["chat", "json", "tools", "thinking"] = "chat"
    stream: bool = True
    interval: Interval = 60.0
    timeout: Interval = 30.0
    max_tokens: Annotated[int, Field(ge=1, le=65536)] = 16
    expect_content: Annotated[str, AfterValidator(_regex)] | None = None
    expect_keys: tuple[Text, ...] = ()
    first_token_timeout: Interval | None = None
    """Deadline for the first token (streaming); `timeout` when unset."""
    stall_timeout: Interval | None = None
    """Longest silence allowed between two chunks (streaming); `timeout` when unset."""

    @model_validator(mode="after")
    def _scenario_keys(self) -> ProbeConfig:
        if self.expect_keys and self.scenario != "json":
            raise ValueError("`expect_keys` applies to the `json` scenario only")
        if self.expect_content and self.scenario not in ("chat", "thinking"):
            raise ValueError("`expect_content` applies to the `chat` and `thinking` scenarios only")
        return self


class PriceConfig(Strict):
    model: Text
    prompt_per_million: Amount
    cached_prompt_per_million: Amount | None = None
    completion_per_million: Amount


def _above_zero(amount: Decimal) -> Decimal:
    if amount <= 0:
        raise ValueError("must be greater than zero")
    return amount


BILLED_SCOPE = ("endpoint_id", "item", "product", "project_id")
"""What a budget's `where` may name to be measured on the bills."""
USAGE_SCOPE = ("model", "api_key")
"""What makes a budget measured on usage × prices instead (`endpoint_id` may join them)."""
ACCOUNT = "account"
"""The label every series of an account carries when the config lists `accounts`; rules and
top-level budgets may name it in `where` (and rules in `by`)."""


class BudgetConfig(Strict):
    name: Name
    amount: Annotated[Decimal, BeforeValidator(parse_amount), AfterValidator(_above_zero)]
    period: Literal["month", "day"] = "month"
    where: dict[str, ScopeValue] = Field(default_factory=dict)
    """The share of the account the budget covers (every label must match one of its values); the
    whole account when empty. With `accounts`, `account` picks the accounts a top-level budget spans
    (all of them without it: the organisation's)."""

    @model_validator(mode="after")
    def _scope(self) -> BudgetConfig:
        keys = set(self.where) - {ACCOUNT}
        for key in sorted(keys - {*BILLED_SCOPE, *USAGE_SCOPE}):
            raise ValueError(
                f"`where` cannot name {key!r}: a budget is scoped on {', '.join(BILLED_SCOPE)} (billed)"
                f" or {', '.join(USAGE_SCOPE)} (usage × prices), and on `account` with `accounts`"
            )
        if {"endpoint_id", "item"} <= keys:
            raise ValueError("`where` names endpoint_id and item: bills are by endpoint or by item, not both")
        if {"project_id", "item"} <= keys:
            raise ValueError("`where` names project_id and item: the bills' lines by item carry no project")
        if keys & set(USAGE_SCOPE) and keys & {"item", "product", "project_id"}:
            raise ValueError(
                "`where` mixes usage labels (model, api_key) with billed ones (item, product, project_id):"
                " usage records carry only endpoint_id, model and api_key"
            )
        for api_key in scope_values(self.where.get("api_key", ())):
            if "*" not in api_key:
                raise ValueError(
                    "`where.api_key` must be the masked key as usage records show it (a prefix and asterisks,"
                    " e.g. sk-ab****): a full key never matches, and does not belong in the config"
                )
        return self

    @property
    def on_usage(self) -> bool:
        """Measured on usage × prices (the scope names a model or an API key), not on the bills."""
        return bool(set(self.where) & set(USAGE_SCOPE))

    @property
    def accounts(self) -> tuple[str, ...] | None:
        """The accounts its `where` names; None when it names none (every account)."""
        wanted = self.where.get(ACCOUNT)
        return None if wanted is None else scope_values(wanted)

    def spans(self, account: str) -> bool:
        """Whether the budget counts `account` (every account when its `where` names none)."""
        return in_scope(self.where.get(ACCOUNT), account)

    def in_account(self) -> BudgetConfig:
        """This budget as one account measures it: its scope without `account`."""
        if ACCOUNT not in self.where:
            return self
        return self.model_copy(update={"where": {k: v for k, v in self.where.items() if k != ACCOUNT}})


if TYPE_CHECKING:
    NotifierConfig = NotifierModel
else:
    NotifierConfig = Union[tuple(kind.model for kind in KINDS.values())]  # noqa: UP007 (built from the registry)
"""Every kind's model, from `exporter.notifiers.registry`: a new kind is its module and its entry there."""
Notifier = Annotated[NotifierConfig, Field(discriminator="type")]


class AlertsConfig(Strict):
    evaluation_interval: Interval = 60.0
    repeat_interval: Interval = 4 * 3600.0
    rules: tuple[RuleConfig, ...] = ()
    notifiers: tuple[Notifier, ...] = ()


def _time_of_day(value: str) -> str:
    if not re.fullmatch(r"([01]\d|2[0-3]):[0-5]\d", value):
        raise ValueError(f"{value!r} is not a time of day as HH:MM (00:00 to 23:59)")
    return value


class DigestConfig(Strict):
    """A summary of the day before, sent at `at` in the billing time zone (weekly: on Mondays)."""

    schedule: Literal["daily", "weekly"] = "daily"
    at: Annotated[str, AfterValidator(_time_of_day)] = "09:00"
    notifiers: Annotated[tuple[Name, ...], Field(min_length=1)]

    @property
    def time(self) -> tuple[int, int]:
        hour, minute = self.at.split(":")
        return int(hour), int(minute)


class TlsConfig(Strict):
    cert_file: Text
    key_file: Text

    @model_validator(mode="after")
    def _readable(self) -> TlsConfig:
        for path in (self.cert_file, self.key_file):
            if not os.path.isfile(path):  # (os.path's: a name too long, or holding a NUL, is no file either)
                raise ValueError(f"file {path[:200]!r} does not exist")
        return self


def _no_colon(username: str) -> str:
    if ":" in username:
        raise ValueError("a user name cannot hold ':' (a client sends the user name and the password joined by one)")
    return username


class BasicAuthConfig(Strict):
    username: Annotated[Text, AfterValidator(_no_colon)]
    password: SecretStr


def _port_in_range(address: str) -> str:
    if int(address.rpartition(":")[2]) > 65535:
        raise ValueError("the port must be 0 to 65535")
    return address


ListenAddress = Annotated[
    str, Field(pattern=r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.-]*):[0-9]{1,5}$"), AfterValidator(_port_in_range)
]


class ServerConfig(Strict):
    listen: ListenAddress = ":9877"
    tls: TlsConfig | None = None
    basic_auth: BasicAuthConfig | None = None
    external_url: HttpUrl | None = None
    """How receivers reach this exporter (links in notifications); the listen address by default."""


RECONCILED_COUNTS = Literal["prompt", "prompt_uncached", "cached_prompt", "completion"]
DEFAULT_RECONCILED_ITEMS: dict[str, RECONCILED_COUNTS] = {
    "ITEM_PROMPT_TOKEN": "prompt_uncached",
    "ITEM_CACHED_PROMPT_TOKEN": "cached_prompt",
    "ITEM_COMPLETION_TOKEN": "completion",
}


class ReconciliationConfig(Strict):
    items: dict[str, RECONCILED_COUNTS] = Field(default_factory=lambda: dict(DEFAULT_RECONCILED_ITEMS))
    """Billing item → the usage count it bills."""
    settle: Duration = 6 * 3600.0
    """How long after a day ends its bill and usage are taken as final."""
    days_per_refresh: Annotated[int, Field(ge=1, le=31)] = 2
    """Past days whose usage is read per usage refresh (the API cost of reconciling, spread out)."""


class ForecastConfig(Strict):
    interval: Annotated[float, Field(gt=0, lt=1)] = 0.8
    """The nominal coverage of the month-end forecast's interval: its bounds are the quantiles
    (1 − interval) ÷ 2 and (1 + interval) ÷ 2 of what the month's total may be."""


class StateConfig(Strict):
    path: Text = "./inference-cost-exporter.db"


def _spelt(spellings: dict[str, str]) -> BeforeValidator:
    """A value as its canonical spelling, the others `--log.level` and `--log.format` take too."""
    return BeforeValidator(lambda value: spellings.get(value, value) if isinstance(value, str) else value)


class LogConfig(Strict):
    level: Annotated[Literal["debug", "info", "warning", "error"], _spelt(LEVELS)] = "info"
    """`warn` is taken for `warning`, as on the command line."""
    format: Annotated[Literal["text", "json"], _spelt(FORMATS)] = "text"
    """`logfmt` is taken for `text`, as on the command line."""


class AccountConfig(Strict):
    """One account of several: its billing API and, optionally, its probes, prices and budgets."""

    name: Name
    billing: BillingConfig
    inference: InferenceConfig | None = None
    probes: tuple[ProbeConfig, ...] = ()
    prices: tuple[PriceConfig, ...] | None = None
    """This account's prices; the top-level `prices` when unset."""
    budgets: tuple[BudgetConfig, ...] = ()
    """Budgets of this account alone (their `where` cannot name `account`)."""

    @field_validator("budgets")
    @classmethod
    def _own_budgets(cls, budgets: tuple[BudgetConfig, ...]) -> tuple[BudgetConfig, ...]:
        for budget in budgets:
            if ACCOUNT in budget.where:
                raise ValueError(
                    f"budget {budget.name!r}: an account's budget is its own; `where.account` belongs to"
                    " a top-level budget"
                )
        return budgets


class Config(Strict):
    billing_: BillingConfig | None = Field(None, alias="billing")
    accounts: tuple[AccountConfig, ...] = ()
    """Several accounts in one exporter; without it, `billing` (and `inference`, `probes`) are the one account's."""
    inference: InferenceConfig | None = None
    probes: tuple[ProbeConfig, ...] = ()
    prices: tuple[PriceConfig, ...] = ()
    budgets: tuple[BudgetConfig, ...] = ()
    alerts: AlertsConfig = AlertsConfig()
    server: ServerConfig = ServerConfig()
    state: StateConfig = StateConfig()
    log: LogConfig = LogConfig()
    reconciliation: ReconciliationConfig = ReconciliationConfig()
    forecast: ForecastConfig = ForecastConfig()
    digest: DigestConfig | None = None

    @model_validator(mode="after")
    def _one_or_several(self) -> Config:
        if self.billing_ is None and not self.accounts:
            raise ValueError("`billing` is required (or `accounts`, a list of accounts each with its `billing`)")
        if self.accounts:
            if self.billing_ is not None:
                raise ValueError("`billing` and `accounts` exclude each other: give each account its `billing`")
            for key in ("inference", "probes"):
                if getattr(self, key):
                    raise ValueError(f"with `accounts`, `{key}` belongs to the account whose endpoints it probes")
            zones = {account.billing.timezone for account in self.accounts}
            if len(zones) > 1:
                raise ValueError(
                    f"the accounts' `billing.timezone` differ ({', '.join(sorted(zones))}): the accounts of one"
                    " exporter share their billing days (run one exporter per time zone)"
                )
        return self

    @property
    def billing(self) -> BillingConfig:
        """The account's `billing`; with `accounts`, the first one's (what they share: the time zone)."""
        if self.billing_ is not None:
            return self.billing_
        return self.accounts[0].billing

    @property
    def several(self) -> bool:
        """The config lists `accounts`: every series and alert of an account carries its name."""
        return bool(self.accounts)

    def alert_routes(self) -> dict[str, tuple[str, ...]]:
        """Per rule id, the notifiers its alerts go to (`rule_routes`)."""
        return dict(zip(rule_ids(self.alerts.rules), self.rule_routes(), strict=True))

    def rule_routes(self) -> list[tuple[str, ...]]:
        """Per rule, in the config's order (no rule id made: `check` reads them so), the notifiers its
        alerts go to: those it names, else every notifier but those the digest names (a digest's
        notifier takes the alerts of the rules that name it, no others)."""
        digest = set(self.digest.notifiers) if self.digest is not None else set()
        default = tuple(n.name for n in self.alerts.notifiers if n.name not in digest)
        return [rule.notifiers or default for rule in self.alerts.rules]

    def account_configs(self) -> tuple[tuple[str, Config], ...]:
        """Each account's name and its config as one account's (`billing`, `inference`, `probes`,
        `prices`, and the budgets it alone is measured on); the name is empty without `accounts`."""
        if not self.accounts:
            return (("", self),)
        return tuple(
            (
                account.name,
                self.model_copy(
                    update={
                        "billing_": account.billing,
                        "accounts": (),
                        "inference": account.inference,
                        "probes": account.probes,
                        "prices": self.prices if account.prices is None else account.prices,
                        "budgets": (
                            *account.budgets,
                            *(b.in_account() for b in self.budgets if b.accounts == (account.name,)),
                        ),
                    }
                ),
            )
            for account in self.accounts
        )

    @property
    def shared_budgets(self) -> tuple[BudgetConfig, ...]:
        """Budgets spanning several accounts (the organisation's, without `where.account`), measured
        on all of them at once; none without `accounts`."""
        if not self.accounts:
            return ()
        return tuple(b for b in self.budgets if b.accounts is None or len(b.accounts) > 1)

    @property
    def all_budgets(self) -> tuple[BudgetConfig, ...]:
        """Every budget, wherever it is defined (names are unique across the config)."""
        return (*self.budgets, *(b for account in self.accounts for b in account.budgets))

    def secret_values(self) -> list[str]:
        """Every secret in the config, and the path of each secret URL (what a library may log of it)."""
        found: list[str] = []

        def walk(node: object) -> None:
            if isinstance(node, SecretStr):
                value = node.get_secret_value()
                found.append(value)
                path = urlsplit(value).path
                if value.startswith(("http://", "https://")) and len(path) > 1:
                    found.append(path)
            elif isinstance(node, Model):
                for name in type(node).model_fields:
                    walk(getattr(node, name))
            elif isinstance(node, tuple):
                for item in node:
                    walk(item)

        walk(self)
        for notifier in self.alerts.notifiers:
            found += notifier.plain_secrets()
        return [value for value in found if value]


Found = Iterator[tuple[tuple[int | str, ...], Any]]


def secret_fields(model: type[Model], raw: Any, path: tuple[int | str, ...] = ()) -> Found:
    """The values a document holds at the schema's secret keys (its `SecretStr` fields), with their
    locations; a list of notifiers is read by each item's `type`."""
    if not isinstance(raw, dict):
        return
    for name, field in model.model_fields.items():
        key = field.alias or name
        if key in raw:
            yield from _secrets_in(field.annotation, raw[key], (*path, key))


def _secrets_in(annotation: Any, raw: Any, path: tuple[int | str, ...]) -> Found:
    if annotation is SecretStr:
        yield path, raw
    elif isinstance(annotation, type) and issubclass(annotation, Model):
        yield from secret_fields(annotation, raw, path)
    elif get_origin(annotation) is Annotated:
        yield from _secrets_in(get_args(annotation)[0], raw, path)
    elif get_origin(annotation) is tuple and isinstance(raw, list):
        for index, item in enumerate(raw):
            yield from _secrets_in(get_args(annotation)[0], item, (*path, index))
    elif get_origin(annotation) in (Union, UnionType):
        members = [m for m in get_args(annotation) if m is not type(None)]
        kind = raw.get("type") if isinstance(raw, dict) else None
        for member in members:
            model = get_args(member)[0] if get_origin(member) is Annotated else member
            fields = getattr(model, "model_fields", {})
            if "type" in fields and kind not in get_args(fields["type"].annotation):
                continue  # another type of notifier
            yield from _secrets_in(member, raw, path)


def keys_at(location: Sequence[int | str], annotation: Any = Config) -> tuple[str, ...]:
    """The keys the mapping at `location` may hold (a validation error's location: list indexes, and
    the tag of the type an item was read as); none where it leads to no model."""
    if get_origin(annotation) is Annotated:
        return keys_at(location, get_args(annotation)[0])
    if get_origin(annotation) in (Union, UnionType):
        members = [m for m in get_args(annotation) if m is not type(None)]
        for member in members:  # an item read as a tagged type: the tag comes next in the location
            if location and location[0] in _tags(member):
                return keys_at(location[1:], member)
        return next((keys for member in members if (keys := keys_at(location, member))), ())
    if get_origin(annotation) is tuple and location and isinstance(location[0], int):
        return keys_at(location[1:], get_args(annotation)[0])
    if get_origin(annotation) is dict and location:
        return keys_at(location[1:], get_args(annotation)[1])
    if not (isinstance(annotation, type) and issubclass(annotation, Model)):
        return ()
    fields = {field.alias or name: field for name, field in annotation.model_fields.items()}
    if not location:
        return tuple(fields)
    field = fields.get(str(location[0]))
    return () if field is None else keys_at(location[1:], field.annotation)


def _tags(annotation: Any) -> tuple[object, ...]:
    """What a member of a tagged union is called in an error's location: its `Tag`, or the value of
    its `type` (a notifier's kind)."""
    if get_origin(annotation) is Annotated:
        model, *metadata = get_args(annotation)
        return (*(m.tag for m in metadata if isinstance(m, Tag)), *_tags(model))
    fields = getattr(annotation, "model_fields", {})
    return get_args(fields["type"].annotation) if "type" in fields else ()
