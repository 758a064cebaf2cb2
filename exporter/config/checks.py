"""Checks across a config's sections, on the document as written (so each problem is told at its
place): duplicate names, references to what is not defined (budgets, notifiers, accounts), rules
and budget scopes that can match nothing, what only several accounts make possible."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

from exporter.model.signals import SIGNALS
from exporter.model.source_names import probe_source
from exporter.notifiers.kind import ResendKind
from exporter.notifiers.registry import KINDS, no_digest

Location = tuple[int | str, ...]


def items(document: dict[str, Any], *keys: str) -> list[tuple[Location, dict[str, Any]]]:
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
    for where, item in items(document, *keys):
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
    names = [str(item.get("name")) for _, item in items(document, "accounts")]
    problems: list[tuple[Location, str]] = _duplicates(document, ("accounts",), "name", "account")
    named = [(where, item.get("where")) for where, item in items(document, "budgets")]
    named += [(where, item.get("where")) for where, item in items(document, "alerts", "rules")]
    for where, scope in named:
        if isinstance(scope, dict) and "account" in scope and not several:
            problems.append(((*where, "where", "account"), "names `account`, which only `accounts` gives"))
        elif isinstance(scope, dict) and "account" in scope and where[0] == "budgets":  # (rules: `_unmatchable`)
            for one in scope["account"] if isinstance(scope["account"], list) else [scope["account"]]:
                if one not in names:
                    problems.append(
                        ((*where, "where", "account"), f"unknown account {one!r} (known: {', '.join(names)})")
                    )
    for where, rule in items(document, "alerts", "rules"):
        by = rule.get("by")
        if isinstance(by, list) and "account" in by and not several:
            problems.append(((*where, "by"), "names `account`, which only `accounts` gives"))
        labels = rule.get("labels")
        if several and isinstance(labels, dict) and "account" in labels:
            problems.append(((*where, "labels", "account"), "`account` is the label of the account an alert is about"))
    for where, account in items(document, "accounts"):
        if items(account, "probes") and not isinstance(account.get("inference"), dict):
            problems.append(((*where, "inference"), "required when the account has `probes` (url and api_key)"))
        problems += [((*where, *at), why) for at, why in _duplicates(account, ("probes",), "name", "probe")]
    return problems


def _rule_notifiers(document: dict[str, Any]) -> list[tuple[Location, str]]:
    known = [str(item.get("name")) for _, item in items(document, "alerts", "notifiers")]
    problems: list[tuple[Location, str]] = []
    for where, rule in items(document, "alerts", "rules"):
        names = rule.get("notifiers")
        for index, name in enumerate(names if isinstance(names, list) else []):
            if name not in known:
                problems.append(
                    ((*where, "notifiers", index), f"unknown notifier {name!r} (known: {', '.join(known) or 'none'})")
                )
    return problems


def _spanned(document: dict[str, Any], scope: object) -> list[dict[str, Any]]:
    """The accounts a top-level rule or budget of `scope` (its `where`) spans: those its `account`
    names, every one without it."""
    wanted = scope.get("account") if isinstance(scope, dict) else None
    names = wanted if isinstance(wanted, list) else None if wanted is None else [wanted]
    return [account for _, account in items(document, "accounts") if names is None or account.get("name") in names]


def _mixed_currencies(accounts: Sequence[tuple[str, dict[str, Any]]]) -> str | None:
    """`prod: CNY, lab: USD` when these (name, billing) are of more than one `billing.currency`; an
    account with none set may be of either, and is not counted."""
    currencies = {name: str(billing.get("currency")) for name, billing in accounts if billing.get("currency")}
    if len(set(currencies.values())) < 2:
        return None
    return ", ".join(f"{name}: {currency}" for name, currency in currencies.items())


def _billing_of(holder: dict[str, Any]) -> dict[str, Any]:
    return holder["billing"] if isinstance(holder.get("billing"), dict) else {}


def _budget_scopes(document: dict[str, Any]) -> list[tuple[Location, str]]:
    """Scopes that cannot be priced or can never match, each naming its budget (with `accounts`,
    against each account the budget is measured on: its own, or those a top-level one spans)."""

    top_prices = {item.get("model") for _, item in items(document, "prices")}
    accounts = [account for _, account in items(document, "accounts")]

    def prices_of(account: dict[str, Any]) -> set[Any]:
        if isinstance(account.get("prices"), list):
            return {item.get("model") for _, item in items(account, "prices")}
        return top_prices

    measured: list[tuple[Location, dict[str, Any], list[tuple[str, dict[str, Any], set[Any]]]]] = []
    for where, budget in items(document, "budgets"):
        if not accounts:
            measured.append((where, budget, [("", _billing_of(document), top_prices)]))
            continue
        spanned = _spanned(document, budget.get("where"))
        measured.append((where, budget, [(str(a.get("name")), _billing_of(a), prices_of(a)) for a in spanned]))
    for at, account in items(document, "accounts"):
        for where, budget in items(account, "budgets"):
            measured.append(((*at, *where), budget, [("", _billing_of(account), prices_of(account))]))
    problems: list[tuple[Location, str]] = []
    for where, budget, spans in measured:
        listed = _mixed_currencies([(name, billing) for name, billing, _ in spans])
        if listed is not None:
            scope = budget.get("where")
            problems.append((
                (*where, "where", "account") if isinstance(scope, dict) and "account" in scope else where,
                f"spans accounts of different currencies ({listed}): their spend adds up to no amount;"
                " scope it to accounts of one (`where: {account: [...]}`)",
            ))  # fmt: skip
        scope = budget.get("where")
        if not isinstance(scope, dict):
            continue
        for name, billing, priced in spans:
            problems += _scope_problems(where, scope, billing, priced, f" (account {name!r})" if name else "")
    return list(dict.fromkeys(problems))


AMOUNTS = ("spend", "estimated_spend")
"""The signals that are money: summed over accounts, theirs must be of one currency."""


def _summed_currencies(document: dict[str, Any], where: Location, rule: dict[str, Any]) -> list[tuple[Location, str]]:
    """A rule on an amount that adds up accounts of different currencies (not split by `account`)."""
    by = rule.get("by")
    if rule.get("signal") not in AMOUNTS or (isinstance(by, list) and "account" in by):
        return []
    spanned = _spanned(document, rule.get("where"))
    listed = _mixed_currencies([(str(account.get("name")), _billing_of(account)) for account in spanned])
    if listed is None:
        return []
    return [(
        (*where, "signal"),
        f"`{rule['signal']}` adds up accounts of different currencies ({listed}), to no amount: split it by"
        " account (`by: [account]`) or scope it to accounts of one (`where: {account: [...]}`)",
    )]  # fmt: skip


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
    types = {item.get("name"): item.get("type") for _, item in items(document, "alerts", "notifiers")}
    kinds = {name: KINDS.get(kind) if isinstance(kind, str) else None for name, kind in types.items()}
    problems: list[tuple[Location, str]] = []
    for index, name in enumerate(names):
        if name not in kinds:
            known = ", ".join(sorted(str(k) for k, v in kinds.items() if not isinstance(v, ResendKind))) or "none"
            problems.append(
                (("digest", "notifiers", index), f"unknown notifier {name!r} (those that take digests: {known})")
            )
        elif (kind := kinds[name]) is not None and (why := no_digest(kind)):
            problems.append((("digest", "notifiers", index), f"{name!r} {why}"))
    return problems


def cross_check(document: dict[str, Any], tolerant: bool = False) -> list[str]:
    """Problems between sections: duplicate names, references to what is not defined, rules that
    can match nothing. Each at its location. `tolerant`: the schema found values of the wrong kind
    (a list where a name belongs): a check one of them trips is left out, the others still run."""
    problems: list[tuple[Location, str]] = []

    def run(check: Callable[[], list[tuple[Location, str]]]) -> None:
        try:
            problems.extend(check())
        except (TypeError, AttributeError, KeyError):
            if not tolerant:
                raise

    probes = [item for _, item in items(document, "probes")]
    several = isinstance(document.get("accounts"), list)
    account_names = [str(item.get("name")) for _, item in items(document, "accounts")] if several else None
    for _, account in items(document, "accounts"):
        probes += [item for _, item in items(account, "probes")]
    if probes and not several and not isinstance(document.get("inference"), dict):
        problems.append((("inference",), "required when there are `probes` (url and api_key)"))
    run(lambda: _duplicates(document, ("probes",), "name", "probe"))
    run(lambda: _duplicates(document, ("prices",), "model", "price for model"))
    run(lambda: _duplicates(document, ("budgets",), "name", "budget"))
    run(lambda: _duplicates(document, ("alerts", "notifiers"), "name", "notifier"))
    budgets = {name for _, item in items(document, "budgets") if isinstance(name := item.get("name"), Hashable)}

    def account_budgets() -> list[tuple[Location, str]]:
        found = []
        for where, account in items(document, "accounts"):
            for at, budget in items(account, "budgets"):
                if not isinstance(name := budget.get("name"), Hashable):
                    continue
                if name in budgets:
                    found.append(((*where, *at, "name"), f"budget {name!r} is defined twice"))
                budgets.add(name)
        return found

    run(account_budgets)
    run(lambda: _accounts(document))
    run(lambda: _rule_notifiers(document))
    priced = items(document, "prices") or any(items(a, "prices") for _, a in items(document, "accounts"))
    for where, rule in items(document, "alerts", "rules"):

        def of_rule(where: Location = where, rule: dict[str, Any] = rule) -> list[tuple[Location, str]]:
            found = []
            signal = SIGNALS.get(str(rule.get("signal")))
            if signal is not None and signal.needs == "prices" and not priced:
                found.append(((*where, "signal"), f"`{rule['signal']}` needs a `prices` table"))
            if rule.get("budget") is not None and rule.get("signal") is None and rule["budget"] not in budgets:
                found.append(((*where, "budget"), f"unknown budget {rule['budget']!r}"))
            unmatchable = _unmatchable(rule, probes, account_names)
            if unmatchable is not None:
                found.append(((*where, *unmatchable[0].split(".")), unmatchable[1]))
            return found + _summed_currencies(document, where, rule)

        run(of_rule)
    run(lambda: _budget_scopes(document))
    run(lambda: _digest_notifiers(document))
    return [f"{location(where)}{rule_name(document, where)}: {problem}" for where, problem in problems]


# --- loading --------------------------------------------------------------------------------


def location(path: tuple[int | str, ...]) -> str:
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "(top level)"


def rule_name(document: dict[str, Any], path: tuple[int | str, ...]) -> str:
    """` (alert NAME)` for a location inside `alerts.rules[i]`, ` (budget 'NAME')` inside
    `budgets[i]` (or an account's), so a message names its rule or budget."""
    if len(path) >= 4 and path[0] == "accounts" and isinstance(path[1], int) and path[2] == "budgets":
        try:
            return rule_name(document["accounts"][path[1]], path[2:])
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
