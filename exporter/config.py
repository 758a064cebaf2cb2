"""YAML configuration → validated, frozen, typed objects.

`${VAR}` anywhere in a string is replaced from the environment. Every problem is reported at
once with its location (`billing.page_size: must be ≤ 500`); secrets are `SecretStr` and never
appear in a message.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterator, Mapping
from decimal import Decimal
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal
from urllib.parse import urlsplit
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    SecretStr,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)

from exporter.decimals import parse_decimal
from exporter.logs import get_logger
from exporter.snapshots import probe_source

if TYPE_CHECKING:
    from exporter.alerts.signals import Signal

REFERENCE = re.compile(r"\$\{(?:file:([^}]+)|([A-Za-z_][A-Za-z0-9_]*))\}")
"""`${VAR}` (an environment variable) or `${file:PATH}` (a file's content, e.g. a mounted secret)."""
SECRET_KEYS = (
    ("billing", "secret_access_key"),
    ("inference", "api_key"),
    ("server", "basic_auth", "password"),
    ("alerts", "notifiers", "*", "routing_key"),
    ("alerts", "notifiers", "*", "url"),  # a Slack webhook URL carries its token
)
DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
OPERATORS = (">", ">=", "<", "<=", "==", "!=")
MAX_TIER = 10
LABEL_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"
RESERVED_LABELS = ("alertname", "alertstate")
RULE_KINDS = ("threshold-rule", "budget-rule")
"""The tags of a rule's two types, which pydantic puts in an error's location."""


log = get_logger(__name__)


class ConfigError(Exception):
    """Every problem found in a config, each as `location: message`."""

    def __init__(self, details: list[str]) -> None:
        super().__init__("\n".join(details))
        self.details = details


def parse_duration(value: Any) -> float:
    """`30s`, `5m`, `1h30m`, `500ms` or a number of seconds → seconds."""
    if isinstance(value, bool):
        raise ValueError("not a duration")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str) and value and DURATION.sub("", value) == "":
        seconds = sum(float(n) * DURATION_UNITS[unit] for n, unit in DURATION.findall(value))
    else:
        raise ValueError("not a duration (use e.g. 30s, 5m, 1h)")
    if seconds < 0:
        raise ValueError("must not be negative")
    return seconds


def parse_amount(value: Any) -> Decimal:
    """An amount or price: decimal text or a number, as the billing API would write it."""
    try:
        return parse_decimal(value)
    except ValueError as error:
        raise ValueError("not a number" if str(error).startswith("not a decimal") else str(error)) from None


def _positive(seconds: float) -> float:
    if seconds <= 0:
        raise ValueError("must be greater than zero")
    return seconds


def _non_negative(amount: Decimal) -> Decimal:
    if amount < 0:
        raise ValueError("must not be negative")
    return amount


def _regex(pattern: str) -> str:
    try:
        re.compile(pattern)
    except re.error as error:
        raise ValueError(f"not a valid regular expression ({error})") from None
    return pattern


Duration = Annotated[float, BeforeValidator(parse_duration)]
Interval = Annotated[float, BeforeValidator(parse_duration), AfterValidator(_positive)]
Amount = Annotated[Decimal, BeforeValidator(parse_amount), AfterValidator(_non_negative)]
Name = Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z0-9_.:-]+$")]
Text = Annotated[str, Field(min_length=1)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)


def _http_url(url: str) -> str:
    if not re.match(r"^https?://[^/\s]+", url):
        raise ValueError("must be an http:// or https:// URL")
    return url.rstrip("/")


HttpUrl = Annotated[str, AfterValidator(_http_url)]


class BillingConfig(Strict):
    url: HttpUrl
    access_key_id: Text
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
    per_api_key: bool = False

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
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"unknown time zone {value!r}") from None
        return value

    @property
    def zone(self) -> ZoneInfo:
        return ZoneInfo(self.timezone)


class InferenceConfig(Strict):
    url: HttpUrl
    api_key: SecretStr


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


class BudgetConfig(Strict):
    name: Name
    amount: Annotated[Decimal, BeforeValidator(parse_amount), AfterValidator(_above_zero)]
    period: Literal["month", "day"] = "month"


def _signals() -> dict[str, Signal]:
    """The signal table. Imported when a rule is checked, not with this module: the table's
    evaluators need the modules that need this one."""
    from exporter.alerts.signals import SIGNALS

    return SIGNALS


class _Rule(Strict):
    alert: Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)

    def _check(self, fields: set[str]) -> None:
        """Label names, and annotation templates naming only `fields`."""
        for name in self.labels:
            if not re.match(LABEL_NAME, name) or name in RESERVED_LABELS:
                raise ValueError(f"label {name!r} is not a valid alert label name")
        for name, template in self.annotations.items():
            for field in re.findall(r"\{([^{}]*)\}", template):
                if field not in fields:
                    raise ValueError(f"annotation {name!r} names unknown field {{{field}}}")


class ThresholdRule(_Rule):
    """A signal per `by` group compared with a threshold (see `exporter.alerts.signals`)."""

    signal: str
    window: Literal["today", "month", "month_forecast"] = "today"
    by: tuple[Name, ...] = ()
    where: dict[str, str] = Field(default_factory=dict)
    op: Literal[OPERATORS] = ">"  # type: ignore[valid-type]
    threshold: Amount
    for_: Duration = Field(0.0, alias="for")
    keep_firing_for: Duration = 0.0

    @field_validator("signal")
    @classmethod
    def _known_signal(cls, signal: str) -> str:
        names = [repr(name) for name in _signals()]
        if signal not in _signals():
            raise ValueError(f"must be one of {', '.join(names[:-1])} or {names[-1]}")
        return signal

    @model_validator(mode="after")
    def _shape(self) -> ThresholdRule:
        signal = _signals()[self.signal]
        for name in (*self.by, *self.where):
            if name not in signal.labels:
                raise ValueError(f"signal {self.signal!r} has no label {name!r} (it has {', '.join(signal.labels)})")
        if self.signal == "spend" and {"endpoint_id", "item"} <= {*self.by, *self.where}:
            raise ValueError("spend is billed by endpoint or by item, not both: use one of them")
        if self.window not in signal.windows:
            windows = ", ".join(signal.windows)
            raise ValueError(f"signal {self.signal!r} has no `{self.window}` window (it has {windows})")
        self._check({"value", "threshold", *self.by, *self.where})
        return self


class BudgetRule(_Rule):
    """A budget's tiers, each firing once per budget period."""

    budget: Name
    tiers: Annotated[tuple[float, ...], Field(min_length=1)]

    @field_validator("tiers")
    @classmethod
    def _tiers(cls, tiers: tuple[float, ...]) -> tuple[float, ...]:
        for tier in tiers:
            if not 0 < tier <= MAX_TIER:
                raise ValueError(f"tier {tier} is outside (0, {MAX_TIER}]")
        if list(tiers) != sorted(set(tiers)):
            raise ValueError("tiers must be increasing and distinct")
        return tiers

    @model_validator(mode="after")
    def _shape(self) -> BudgetRule:
        self._check({"value", "budget", "tier", "amount", "period"})
        return self


_NOT_FOR_KIND = {
    "budget-rule": "does not apply to a budget rule (it fires once per tier per period)",
    "threshold-rule": "does not apply to a threshold rule (a rule has either `signal` with `threshold`, "
    "or `budget` with `tiers`)",
}
"""Messages for a key of the other kind of rule (pydantic puts the kind after the rule's index)."""


def _rule_kind(rule: Any) -> str:
    if isinstance(rule, dict):
        return "budget-rule" if rule.get("budget") is not None and rule.get("signal") is None else "threshold-rule"
    return "budget-rule" if isinstance(rule, BudgetRule) else "threshold-rule"


RuleConfig = Annotated[
    Annotated[ThresholdRule, Tag("threshold-rule")] | Annotated[BudgetRule, Tag("budget-rule")],
    Discriminator(_rule_kind),
]
"""A rule is a threshold rule (`signal`) or a budget rule (`budget`): the keys it has say which."""


class _Notifier(Strict):
    name: Name


class AlertmanagerNotifier(_Notifier):
    type: Literal["alertmanager"]
    urls: Annotated[tuple[HttpUrl, ...], Field(min_length=1)]


class WebhookNotifier(_Notifier):
    type: Literal["webhook"]
    url: HttpUrl


class SlackNotifier(_Notifier):
    type: Literal["slack"]
    url: SecretStr


class PagerDutyNotifier(_Notifier):
    type: Literal["pagerduty"]
    routing_key: SecretStr
    url: HttpUrl = "https://events.pagerduty.com/v2/enqueue"


Notifier = Annotated[
    AlertmanagerNotifier | WebhookNotifier | SlackNotifier | PagerDutyNotifier, Field(discriminator="type")
]


class AlertsConfig(Strict):
    evaluation_interval: Interval = 60.0
    repeat_interval: Interval = 4 * 3600.0
    rules: tuple[RuleConfig, ...] = ()
    notifiers: tuple[Notifier, ...] = ()


class TlsConfig(Strict):
    cert_file: Text
    key_file: Text

    @model_validator(mode="after")
    def _readable(self) -> TlsConfig:
        for path in (self.cert_file, self.key_file):
            if not Path(path).is_file():
                raise ValueError(f"file {path!r} does not exist")
        return self


class BasicAuthConfig(Strict):
    username: Text
    password: SecretStr


def _port_in_range(address: str) -> str:
    if int(address.rpartition(":")[2]) > 65535:
        raise ValueError("the port must be 0 to 65535")
    return address


ListenAddress = Annotated[
    str, Field(pattern=r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.-]*):\d{1,5}$"), AfterValidator(_port_in_range)
]


class ServerConfig(Strict):
    listen: ListenAddress = ":9877"
    tls: TlsConfig | None = None
    basic_auth: BasicAuthConfig | None = None
    external_url: HttpUrl | None = None
    """How receivers reach this exporter (links in notifications); the listen address by default."""


class StateConfig(Strict):
    path: Text = "./inference-cost-exporter.db"


class LogConfig(Strict):
    level: Literal["debug", "info", "warning", "error"] = "info"
    format: Literal["text", "json"] = "text"


class Config(Strict):
    billing: BillingConfig
    inference: InferenceConfig | None = None
    probes: tuple[ProbeConfig, ...] = ()
    prices: tuple[PriceConfig, ...] = ()
    budgets: tuple[BudgetConfig, ...] = ()
    alerts: AlertsConfig = AlertsConfig()
    server: ServerConfig = ServerConfig()
    state: StateConfig = StateConfig()
    log: LogConfig = LogConfig()

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
            elif isinstance(node, BaseModel):
                for name in type(node).model_fields:
                    walk(getattr(node, name))
            elif isinstance(node, tuple):
                for item in node:
                    walk(item)

        walk(self)
        for notifier in self.alerts.notifiers:  # a token in a plain webhook URL's query is a secret too
            if isinstance(notifier, WebhookNotifier) and urlsplit(notifier.url).query:
                found.append(urlsplit(notifier.url).query)
        return [value for value in found if value]


# --- checks across sections (on the document, so they run whatever else is wrong) ------------

Location = tuple[int | str, ...]


def _items(document: dict[str, Any], *keys: str) -> list[tuple[Location, dict[str, Any]]]:
    """The mappings in the list at `keys`, with their locations (anything malformed is left to the schema)."""
    node: Any = document
    for key in keys:
        node = node.get(key) if isinstance(node, dict) else None
    if not isinstance(node, list):
        return []
    return [((*keys, index), item) for index, item in enumerate(node) if isinstance(item, dict)]


def _duplicates(document: dict[str, Any], keys: tuple[str, ...], field: str, what: str) -> list[tuple[Location, str]]:
    problems: list[tuple[Location, str]] = []
    first: dict[object, Location] = {}
    for where, item in _items(document, *keys):
        name = item.get(field)
        if not isinstance(name, str):
            continue
        if name in first:
            problems.append(((*where, field), f"{what} {name!r} is defined twice (first at {location(first[name])})"))
        else:
            first[name] = where
    return problems


def _unmatchable(rule: dict[str, Any], probes: list[dict[str, Any]]) -> tuple[str, str] | None:
    """Why a rule can never match anything in this config (the key at fault and the reason), or
    None: probe signals with no probe, and `where` values outside the sets the config itself
    defines (probe names, scenarios, sources). Values the API defines (endpoints, models, items)
    are not known here, so they are not checked."""
    signal = _signals().get(str(rule.get("signal")))
    if signal is not None and signal.needs == "probes" and not probes:
        return "signal", f"signal {rule['signal']!r} needs a probe, and `probes` is empty"
    known = {
        "probe": {p.get("name") for p in probes},
        "scenario": {p.get("scenario", "chat") for p in probes},
        "source": {"bills", "usage", *(probe_source(str(p.get("name"))) for p in probes)},
    }
    where = rule.get("where")
    for label, wanted in where.items() if isinstance(where, dict) else ():
        if label in known and wanted not in known[label]:
            choices = ", ".join(sorted(str(k) for k in known[label])) or "none"
            return f"where.{label}", f"{wanted!r} matches nothing (known: {choices})"
    return None


def cross_check(document: dict[str, Any]) -> list[str]:
    """Problems between sections: duplicate names, references to what is not defined, rules that
    can match nothing. Each at its location."""
    problems: list[tuple[Location, str]] = []
    probes = [item for _, item in _items(document, "probes")]
    if probes and not isinstance(document.get("inference"), dict):
        problems.append((("inference",), "required when there are `probes` (url and api_key)"))
    problems += _duplicates(document, ("probes",), "name", "probe")
    problems += _duplicates(document, ("prices",), "model", "price for model")
    problems += _duplicates(document, ("budgets",), "name", "budget")
    problems += _duplicates(document, ("alerts", "notifiers"), "name", "notifier")
    budgets = {item.get("name") for _, item in _items(document, "budgets")}
    for where, rule in _items(document, "alerts", "rules"):
        signal = _signals().get(str(rule.get("signal")))
        if signal is not None and signal.needs == "prices" and not _items(document, "prices"):
            problems.append(((*where, "signal"), f"`{rule['signal']}` needs a `prices` table"))
        if rule.get("budget") is not None and rule.get("signal") is None and rule["budget"] not in budgets:
            problems.append(((*where, "budget"), f"unknown budget {rule['budget']!r}"))
        unmatchable = _unmatchable(rule, probes)
        if unmatchable is not None:
            problems.append(((*where, *unmatchable[0].split(".")), unmatchable[1]))
    return [f"{location(where)}{_rule_name(document, where)}: {problem}" for where, problem in problems]


# --- loading --------------------------------------------------------------------------------


class _StrictLoader(yaml.SafeLoader):
    """Safe YAML that refuses a key given twice in one mapping."""


def _mapping(loader: _StrictLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    loader.flatten_mapping(node)
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)
        if key in seen:
            raise yaml.constructor.ConstructorError(None, None, f"key {key!r} is given twice", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def location(path: tuple[int | str, ...]) -> str:
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "(top level)"


def substitute(
    node: Any, environ: Mapping[str, str], path: tuple[int | str, ...], missing: dict[tuple[int | str, ...], str]
) -> Any:
    """Replace `${VAR}` and `${file:PATH}` in every string; note in `missing` why a path could not be filled."""
    if isinstance(node, dict):
        return {key: substitute(value, environ, (*path, key), missing) for key, value in node.items()}
    if isinstance(node, list):
        return [substitute(value, environ, (*path, i), missing) for i, value in enumerate(node)]
    if not isinstance(node, str):
        return node

    def replace(match: re.Match[str]) -> str:
        if match[1] is not None:
            try:
                return Path(match[1]).read_text(encoding="utf-8").strip()
            except OSError as error:
                missing.setdefault(path, f"cannot read secret file {match[1]} ({error.strerror})")
                return match[0]
        if match[2] not in environ:
            missing.setdefault(path, f"environment variable {match[2]} is not set")
            return match[0]
        return environ[match[2]]

    return REFERENCE.sub(replace, node)


def _at(node: Any, keys: tuple[str, ...]) -> Iterator[tuple[tuple[int | str, ...], Any]]:
    """The values at a key path (`*` = every item of a list)."""
    if not keys:
        yield (), node
        return
    head, rest = keys[0], keys[1:]
    if head == "*" and isinstance(node, list):
        for index, item in enumerate(node):
            for path, value in _at(item, rest):
                yield (index, *path), value
    elif isinstance(node, dict) and head in node:
        for path, value in _at(node[head], rest):
            yield (head, *path), value


def _at_path(node: Any, path: tuple[int | str, ...]) -> Any:
    for part in path:
        node = node[part]
    return node


def secret_warnings(raw: Any, path: Path) -> list[str]:
    """Secrets written into the config file itself rather than taken from the environment or a file."""
    warnings = []
    for keys in SECRET_KEYS:
        for where, value in _at(raw, keys):
            if isinstance(value, str) and value and not REFERENCE.search(value):
                if keys[-1] == "url" and "hooks.slack.com" not in value and not value.startswith("https://hooks."):
                    continue  # a webhook URL is a secret only when it carries a token (Slack's do)
                warnings.append(
                    f"{location(where)}: a secret is written in the config file; use ${{VAR}} or ${{file:PATH}}"
                )
    if warnings and path.stat().st_mode & stat.S_IROTH:
        warnings.append(f"{path}: the file is world-readable and holds secrets (chmod o-r)")
    return warnings


_MESSAGES = {
    "missing": "required key is missing",
    "extra_forbidden": "unknown key",
    "int_type": "not an integer",
    "int_parsing": "not an integer",
    "int_from_float": "not an integer",
    "bool_type": "not true or false",
    "bool_parsing": "not true or false",
    "string_type": "not a string",
    "dict_type": "not a mapping",
    "model_type": "not a mapping",
    "tuple_type": "not a list",
    "string_too_short": "must not be empty",
    "too_short": "must not be empty",
    "float_type": "not a number",
    "float_parsing": "not a number",
}


def _message(error: Any) -> str:
    kind = error["type"]
    context = error.get("ctx") or {}
    if kind in _MESSAGES:
        return _MESSAGES[kind]
    if kind == "less_than_equal":
        return f"must be ≤ {context['le']}"
    if kind == "greater_than_equal":
        return f"must be ≥ {context['ge']}"
    if kind == "literal_error":
        return f"must be one of {context['expected']}"
    if kind == "union_tag_invalid":
        return f"unknown type {context['tag']!r} (expected one of {context['expected_tags']})"
    if kind == "union_tag_not_found":
        return "missing `type`"
    if kind == "string_pattern_mismatch":
        return "contains characters that are not allowed"
    if kind == "value_error":
        return str(context.get("error", error["msg"]))
    return str(error["msg"])


def _rule_name(document: dict[str, Any], path: tuple[int | str, ...]) -> str:
    """` (alert NAME)` for a location inside `alerts.rules[i]`, so a message names its rule."""
    if len(path) < 3 or path[:2] != ("alerts", "rules") or not isinstance(path[2], int):
        return ""
    try:
        name = document["alerts"]["rules"][path[2]]["alert"]
    except (KeyError, IndexError, TypeError):
        return ""
    return f" (alert {name})" if isinstance(name, str) else ""


def validate(raw: Any, environ: Mapping[str, str] | None = None) -> Config:
    environ = os.environ if environ is None else environ
    missing: dict[tuple[int | str, ...], str] = {}
    document = substitute(raw if raw is not None else {}, environ, (), missing)
    if not isinstance(document, dict):
        raise ConfigError(["(top level): the config must be a mapping"])
    errors = [f"{location(path)}: {problem}" for path, problem in missing.items()]
    for _, rule in _items(document, "alerts", "rules"):  # `budget: null` beside `signal` means no budget
        for key in ("signal", "budget"):
            if key in rule and rule[key] is None:
                del rule[key]
    try:
        config = Config.model_validate(document)
    except ValidationError as invalid:
        for error in invalid.errors():
            path = tuple(
                "for" if p == "for_" else p
                for p in error["loc"]
                if not (isinstance(p, str) and (p.endswith("Notifier") or p in RULE_KINDS))
            )
            if path not in missing:
                loc = error["loc"]
                kind = loc[3] if error["type"] == "extra_forbidden" and loc[:2] == ("alerts", "rules") else None
                message = _NOT_FOR_KIND.get(str(kind)) or _message(error)
                errors.append(f"{location(path)}{_rule_name(document, path)}: {message}")
    errors += cross_check(document)
    if errors:
        raise ConfigError(errors)
    return config


def load(path: str | Path, environ: Mapping[str, str] | None = None) -> Config:
    """Load and validate a config file; warnings about secrets written in it go to the log."""
    config, warnings = load_checked(path, environ)
    for warning in warnings:
        log.warning("config warning", detail=warning)
    return config


def load_checked(path: str | Path, environ: Mapping[str, str] | None = None) -> tuple[Config, list[str]]:
    """The validated config and the warnings about it (secrets written in the file)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as error:
        raise ConfigError([f"{path}: cannot read ({error.strerror})"]) from None
    try:
        raw = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        problem = getattr(error, "problem", None) or str(error)
        raise ConfigError([f"{where}: invalid YAML: {problem}"]) from None
    return validate(raw, environ), secret_warnings(raw, Path(path))
