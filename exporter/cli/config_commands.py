"""The commands that only read a config (`check`, `rules`), and what every command shares: loading
the config, choosing accounts, the exit statuses. They import no HTTP client, scheduler or server,
so that they start quickly (`bench.startup`)."""

from __future__ import annotations

import argparse
import sys

from exporter.alerts.promrules import rule_file
from exporter.config.load import ConfigError, load_checked
from exporter.config.schema import Config
from exporter.core.words import counted
from exporter.state.location import location_problem

EXIT_CONFIG = 1
EXIT_SOURCE = 2
EXIT_USAGE = 2


def load_config(path: str) -> Config:
    try:
        config, warnings = load_checked(path)
    except ConfigError as error:
        for detail in error.details:
            print(f"{path}: {detail}" if not detail.startswith(path) else detail, file=sys.stderr)
        raise SystemExit(EXIT_CONFIG) from None
    for warning in warnings:
        print(f"{path}: warning: {warning}", file=sys.stderr)
    return config


def chosen_accounts(
    config: Config, args: argparse.Namespace, command: str, every: bool = False
) -> list[tuple[str, Config]]:
    """The accounts a command works on: the config's one; with `accounts`, the one `--account`
    names (or every one, where the command can: `every`). SystemExit for a name that is none."""
    named = config.account_configs()
    wanted = getattr(args, "account", None)
    if wanted is None:
        if config.several and not every:
            names = ", ".join(name for name, _ in named)
            print(f"inference-cost-exporter {command}: the config lists accounts: name one with --account ({names})",
                  file=sys.stderr)  # fmt: skip
            raise SystemExit(EXIT_USAGE)
        return list(named)
    chosen = [(name, account) for name, account in named if name == wanted]
    if not chosen:
        known = ", ".join(name for name, _ in named if name) or "none: the config has no `accounts`"
        print(f"inference-cost-exporter {command}: no account {wanted!r} (accounts: {known})", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)
    return chosen


def cmd_check(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    problem = location_problem(config.state.path)
    if problem:  # a warning: the file may be checked on another machine than the one it runs on
        print(
            f"{args.config}: warning: state.path: on this machine no state file can be kept at "
            f"{config.state.path}: {problem}",
            file=sys.stderr,
        )
    digest = config.digest
    sends = f"; digest {digest.schedule} at {digest.at} to {', '.join(digest.notifiers)}" if digest else ""
    probes = sum(len(account.probes) for _, account in config.account_configs())
    accounts = f"{counted(len(config.accounts), 'account')}, " if config.several else ""
    amounts = "" if config.several else f"; {_currency(config.billing.currency)}"
    print(
        f"{args.config}: valid ({accounts}{counted(probes, 'probe')}, {counted(len(config.all_budgets), 'budget')}, "
        f"{counted(len(config.alerts.rules), 'rule')}, {counted(len(config.alerts.notifiers), 'notifier')}"
        f"{amounts}{sends})"
    )
    for name, account in config.account_configs() if config.several else ():
        print(
            f"  account {name}: {account.billing.url}, {counted(len(account.probes), 'probe')}, "
            f"{counted(len(account.budgets), 'budget')}; {_currency(account.billing.currency)}"
        )
    for rule, routed in zip(config.alerts.rules, config.rule_routes(), strict=True):
        print(f"  rule {rule.alert}: to {', '.join(routed) or 'no notifier'}")
    return 0


def _currency(code: str) -> str:
    return f"amounts in {code}" if code else "currency not set (billing.currency)"


def cmd_rules(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    text, skipped = rule_file(config.alerts, config.all_budgets, config.billing.zone)
    for note in skipped:
        print(f"{args.config}: {note}", file=sys.stderr)
    sys.stdout.write(text)
    return 0
