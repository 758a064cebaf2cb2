"""Loading a config: YAML → `${VAR}`/`${file:PATH}` → the schema (`exporter.config.schema`) → checks across sections.

`${VAR}` anywhere in a string is replaced from the environment. Every problem is reported at
once with its location (`billing.page_size: must be ≤ 500`); secrets are `SecretStr` and never
appear in a message.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import (
    ValidationError,
)

from exporter.config.rules import twin_rules
from exporter.config.schema import Config, secret_fields
from exporter.core.logs import get_logger
from exporter.model.signals import SIGNALS
from exporter.model.snapshots import probe_source
from exporter.notifiers.kind import ResendKind
from exporter.notifiers.registry import KINDS, no_digest
from exporter.notifiers.webhook import webhook_secret

REFERENCE = re.compile(r"\$\{(?:file:([^}]+)|([A-Za-z_][A-Za-z0-9_]*))\}")
"""`${VAR}` (an environment variable) or `${file:PATH}` (a file's content, e.g. a mounted secret)."""
RULE_KINDS = ("threshold-rule", "budget-rule", "anomaly-rule")
"""The tags of a rule's types, which pydantic puts in an error's location."""


log = get_logger(__name__)


class ConfigError(Exception):
    """Every problem found in a config, each as `location: message`."""

    def __init__(self, details: list[str]) -> None:
        super().__init__("\n".join(details))
        self.details = details


_NOT_FOR_KIND = {
    "budget-rule": "does not apply to a budget rule (it fires once per tier per period)",
    "threshold-rule": "does not apply to a threshold rule (a rule has either `signal` with `threshold`, "
    "or `budget` with `tiers`)",
    "anomaly-rule": "does not apply to a spend_anomaly rule (it has `by`, `min_amount`, `min_percent` and "
    "`sensitivity`: see the README)",
}
"""Messages for a key of the other kind of rule (pydantic puts the kind after the rule's index)."""


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


def _unmatchable(
    rule: dict[str, Any], probes: list[dict[str, Any]], accounts: list[str] | None = None
) -> tuple[str, str] | None:
    """Why a rule can never match anything in this config (the key at fault and the reason), or
    None: probe signals with no probe, and `where` values outside the sets the config itself
    defines (probe names, scenarios, sources). Values the API defines (endpoints, models, items)
    are not known here, so they are not checked."""
    signal = SIGNALS.get(str(rule.get("signal")))
    if signal is not None and signal.needs == "probes" and not probes:
        return "signal", f"signal {rule['signal']!r} needs a probe, and `probes` is empty"
    known = {
        "probe": {p.get("name") for p in probes},
        "scenario": {p.get("scenario", "chat") for p in probes},
        "source": {"bills", "usage", *(probe_source(str(p.get("name"))) for p in probes)},
    }
    if accounts is not None:
        known["account"] = set(accounts)
    where = rule.get("where")
    for label, wanted in where.items() if isinstance(where, dict) else ():
        for one in wanted if isinstance(wanted, list) else [wanted]:
            if label in known and one not in known[label]:
                choices = ", ".join(sorted(str(k) for k in known[label])) or "none"
                return f"where.{label}", f"{one!r} matches nothing (known: {choices})"
    return None


def _accounts(document: dict[str, Any]) -> list[tuple[Location, str]]:
    """What only several accounts make possible, named where there are none; and what an account
    names that it does not have."""
    several = isinstance(document.get("accounts"), list)
    names = [str(item.get("name")) for _, item in _items(document, "accounts")]
    problems: list[tuple[Location, str]] = _duplicates(document, ("accounts",), "name", "account")
    named = [(where, item.get("where")) for where, item in _items(document, "budgets")]
    named += [(where, item.get("where")) for where, item in _items(document, "alerts", "rules")]
    for where, scope in named:
        if isinstance(scope, dict) and "account" in scope and not several:
            problems.append(((*where, "where", "account"), "names `account`, which only `accounts` gives"))
        elif isinstance(scope, dict) and "account" in scope and where[0] == "budgets":  # (rules: `_unmatchable`)
            for one in scope["account"] if isinstance(scope["account"], list) else [scope["account"]]:
                if one not in names:
                    problems.append(
                        ((*where, "where", "account"), f"unknown account {one!r} (known: {', '.join(names)})")
                    )
    for where, rule in _items(document, "alerts", "rules"):
        by = rule.get("by")
        if isinstance(by, list) and "account" in by and not several:
            problems.append(((*where, "by"), "names `account`, which only `accounts` gives"))
        labels = rule.get("labels")
        if several and isinstance(labels, dict) and "account" in labels:
            problems.append(((*where, "labels", "account"), "`account` is the label of the account an alert is about"))
    for where, account in _items(document, "accounts"):
        if _items(account, "probes") and not isinstance(account.get("inference"), dict):
            problems.append(((*where, "inference"), "required when the account has `probes` (url and api_key)"))
        problems += [((*where, *at), why) for at, why in _duplicates(account, ("probes",), "name", "probe")]
    return problems


def _rule_notifiers(document: dict[str, Any]) -> list[tuple[Location, str]]:
    known = [str(item.get("name")) for _, item in _items(document, "alerts", "notifiers")]
    problems: list[tuple[Location, str]] = []
    for where, rule in _items(document, "alerts", "rules"):
        names = rule.get("notifiers")
        for index, name in enumerate(names if isinstance(names, list) else []):
            if name not in known:
                problems.append(
                    ((*where, "notifiers", index), f"unknown notifier {name!r} (known: {', '.join(known) or 'none'})")
                )
    return problems


def _budget_scopes(document: dict[str, Any]) -> list[tuple[Location, str]]:
    """Scopes that cannot be priced or can never match, each naming its budget (with `accounts`,
    against each account the budget is measured on: its own, or those a top-level one spans)."""

    def billing_of(holder: dict[str, Any]) -> dict[str, Any]:
        return holder["billing"] if isinstance(holder.get("billing"), dict) else {}

    top_prices = {item.get("model") for _, item in _items(document, "prices")}
    accounts = [account for _, account in _items(document, "accounts")]

    def prices_of(account: dict[str, Any]) -> set[Any]:
        if isinstance(account.get("prices"), list):
            return {item.get("model") for _, item in _items(account, "prices")}
        return top_prices

    measured: list[tuple[Location, dict[str, Any], list[tuple[str, dict[str, Any], set[Any]]]]] = []
    for where, budget in _items(document, "budgets"):
        scope = budget.get("where")
        if not accounts:
            measured.append((where, budget, [("", billing_of(document), top_prices)]))
            continue
        wanted = scope.get("account") if isinstance(scope, dict) else None
        names = wanted if isinstance(wanted, list) else None if wanted is None else [wanted]
        spanned = [a for a in accounts if names is None or a.get("name") in names]
        measured.append((where, budget, [(str(a.get("name")), billing_of(a), prices_of(a)) for a in spanned]))
    for at, account in _items(document, "accounts"):
        for where, budget in _items(account, "budgets"):
            measured.append(((*at, *where), budget, [("", billing_of(account), prices_of(account))]))
    problems: list[tuple[Location, str]] = []
    for where, budget, spans in measured:
        scope = budget.get("where")
        if not isinstance(scope, dict):
            continue
        for name, billing, priced in spans:
            problems += _scope_problems(where, scope, billing, priced, f" (account {name!r})" if name else "")
    return list(dict.fromkeys(problems))


def _scope_problems(
    where: Location, scope: dict[str, Any], billing: dict[str, Any], priced: set[Any], account: str
) -> list[tuple[Location, str]]:
    problems: list[tuple[Location, str]] = []
    model, api_key, project = scope.get("model"), scope.get("api_key"), scope.get("project_id")
    for one in model if isinstance(model, list) else [] if model is None else [model]:
        if isinstance(one, str) and one not in priced:
            problems.append(((*where, "where", "model"), f"model {one!r} has no entry in `prices`{account}"))
    if api_key is not None and not priced:
        problems.append(
            ((*where, "where", "api_key"), f"a scope on api_key is priced from `prices`, which is empty{account}")
        )
    if api_key is not None and billing.get("per_api_key") is not True:
        problems.append(
            (
                (*where, "where", "api_key"),
                f"usage is counted per API key only with `billing.per_api_key: true`{account}",
            )
        )
    wanted = billing.get("project_id")
    if isinstance(project, str) and isinstance(wanted, str) and wanted and project != wanted:
        problems.append(
            ((*where, "where", "project_id"), f"matches nothing: `billing.project_id` is {wanted!r}{account}")
        )
    return problems


def _digest_notifiers(document: dict[str, Any]) -> list[tuple[Location, str]]:
    digest = document.get("digest")
    names = digest.get("notifiers") if isinstance(digest, dict) else None
    if not isinstance(names, list):
        return []
    types = {item.get("name"): item.get("type") for _, item in _items(document, "alerts", "notifiers")}
    kinds = {name: KINDS.get(kind) if isinstance(kind, str) else None for name, kind in types.items()}
    problems: list[tuple[Location, str]] = []
    for index, name in enumerate(names):
        if name not in kinds:
            known = ", ".join(sorted(str(k) for k, v in kinds.items() if not isinstance(v, ResendKind))) or "none"
            problems.append((("digest", "notifiers", index), f"unknown notifier {name!r} (known: {known})"))
        elif (kind := kinds[name]) is not None and (why := no_digest(kind)):
            problems.append((("digest", "notifiers", index), f"{name!r} {why}"))
    return problems


def cross_check(document: dict[str, Any]) -> list[str]:
    """Problems between sections: duplicate names, references to what is not defined, rules that
    can match nothing. Each at its location."""
    problems: list[tuple[Location, str]] = []
    probes = [item for _, item in _items(document, "probes")]
    several = isinstance(document.get("accounts"), list)
    account_names = [str(item.get("name")) for _, item in _items(document, "accounts")] if several else None
    for _, account in _items(document, "accounts"):
        probes += [item for _, item in _items(account, "probes")]
    if probes and not several and not isinstance(document.get("inference"), dict):
        problems.append((("inference",), "required when there are `probes` (url and api_key)"))
    problems += _duplicates(document, ("probes",), "name", "probe")
    problems += _duplicates(document, ("prices",), "model", "price for model")
    problems += _duplicates(document, ("budgets",), "name", "budget")
    problems += _duplicates(document, ("alerts", "notifiers"), "name", "notifier")
    budgets = {item.get("name") for _, item in _items(document, "budgets")}
    for where, account in _items(document, "accounts"):
        for at, budget in _items(account, "budgets"):
            if budget.get("name") in budgets:
                problems.append(((*where, *at, "name"), f"budget {budget.get('name')!r} is defined twice"))
            budgets.add(budget.get("name"))
    problems += _accounts(document)
    problems += _rule_notifiers(document)
    for where, rule in _items(document, "alerts", "rules"):
        signal = SIGNALS.get(str(rule.get("signal")))
        priced = _items(document, "prices") or any(_items(a, "prices") for _, a in _items(document, "accounts"))
        if signal is not None and signal.needs == "prices" and not priced:
            problems.append(((*where, "signal"), f"`{rule['signal']}` needs a `prices` table"))
        if rule.get("budget") is not None and rule.get("signal") is None and rule["budget"] not in budgets:
            problems.append(((*where, "budget"), f"unknown budget {rule['budget']!r}"))
        unmatchable = _unmatchable(rule, probes, account_names)
        if unmatchable is not None:
            problems.append(((*where, *unmatchable[0].split(".")), unmatchable[1]))
    problems += _budget_scopes(document)
    problems += _digest_notifiers(document)
    return [f"{location(where)}{_rule_name(document, where)}: {problem}" for where, problem in problems]


# --- loading --------------------------------------------------------------------------------


class _StrictLoader(yaml.SafeLoader):
    """Safe YAML that refuses a key given twice in one mapping."""


def _mapping(loader: _StrictLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    loader.flatten_mapping(node)
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)
        if isinstance(key, dict | list):
            raise yaml.constructor.ConstructorError(
                None, None, "a key must be a plain value, not a mapping or a list", key_node.start_mark
            )
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


def _at_path(node: Any, path: tuple[int | str, ...]) -> Any:
    for part in path:
        node = node[part]
    return node


def secret_warnings(raw: Any, path: Path) -> list[str]:
    """Secrets written into the config file itself rather than taken from the environment or a file."""
    warnings = []
    webhooks = [
        ((*where, "url"), item["url"])
        for where, item in _items(raw if isinstance(raw, dict) else {}, "alerts", "notifiers")
        if item.get("type") == "webhook" and isinstance(item.get("url"), str) and webhook_secret(item["url"])
    ]
    for where, value in [*secret_fields(Config, raw), *webhooks]:
        if isinstance(value, str) and value and not REFERENCE.search(value):
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
    """` (alert NAME)` for a location inside `alerts.rules[i]`, ` (budget 'NAME')` inside
    `budgets[i]` (or an account's), so a message names its rule or budget."""
    if len(path) >= 4 and path[0] == "accounts" and isinstance(path[1], int) and path[2] == "budgets":
        try:
            return _rule_name(document["accounts"][path[1]], path[2:])
        except (KeyError, IndexError, TypeError):
            return ""
    if len(path) >= 2 and path[0] == "budgets" and isinstance(path[1], int) and path[2:] != ("name",):
        try:
            budget = document["budgets"][path[1]]["name"]
        except (KeyError, IndexError, TypeError):
            return ""
        return f" (budget {budget!r})" if isinstance(budget, str) else ""
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
                for n, p in enumerate(error["loc"])
                if not (isinstance(p, str) and (p.endswith("Notifier") or p in RULE_KINDS))
                and not (n == 3 and error["loc"][:2] == ("alerts", "notifiers"))  # the `type` it was read as
            )
            if path not in missing:
                loc = error["loc"]
                kind = loc[3] if error["type"] == "extra_forbidden" and loc[:2] == ("alerts", "rules") else None
                message = _NOT_FOR_KIND.get(str(kind)) or _message(error)
                errors.append(f"{location(path)}{_rule_name(document, path)}: {message}")
    errors += cross_check(document)
    if not errors:
        for earlier, later in twin_rules(config.alerts.rules):
            path = ("alerts", "rules", later)
            errors.append(
                f"{location(path)}{_rule_name(document, path)}: makes the same alerts as alerts.rules[{earlier}]"
                " (the same alert name, what it watches and labels); give one of them other `labels`, a severity"
            )
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
