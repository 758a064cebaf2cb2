"""Config loading: every error at once, with its location; `${VAR}` substitution; frozen objects."""

from __future__ import annotations

import os
import threading
from decimal import Decimal
from pathlib import Path

import pytest

from exporter.config.load import ConfigError, load, parse_yaml, validate
from exporter.core.fields import parse_duration
from exporter.core.typed import ValidationError

ROOT = Path(__file__).parent.parent
BILLING = {"url": "https://openapi.example.com", "access_key_id": "AK1", "secret_access_key": "${SECRET}"}
ENV = {"SECRET": "top-secret-value"}


def errors_of(document: dict, environ: dict | None = None) -> list[str]:
    with pytest.raises(ConfigError) as raised:
        validate(document, ENV if environ is None else environ)
    return raised.value.details


def test_minimal_config_gets_the_documented_defaults() -> None:
    config = validate({"billing": BILLING}, ENV)
    billing = config.billing
    assert billing.secret_access_key.get_secret_value() == "top-secret-value"
    assert (billing.bills_interval, billing.usage_interval, billing.timeout) == (900.0, 300.0, 30.0)
    assert (billing.page_size, billing.concurrency, billing.previous_month_grace_days) == (500, 4, 3)
    assert (billing.timezone, billing.signature_label, billing.signature_lifetime) == ("Asia/Shanghai", "svc", 300.0)
    assert config.server.listen == ":9877"
    assert config.alerts.repeat_interval == 4 * 3600


def test_config_is_frozen() -> None:
    config = validate({"billing": BILLING}, ENV)
    with pytest.raises(ValidationError):
        config.billing.page_size = 5  # type: ignore[misc]


SPACE = "holds a space or a control character: percent-encode it (a space is %20)"


@pytest.mark.parametrize(
    ("document", "expected"),
    [
        ({}, "(top level): `billing` is required (or `accounts`, a list of accounts each with its `billing`)"),
        ({"billing": {k: v for k, v in BILLING.items() if k != "url"}}, "billing.url: required key is missing"),
        ({"billing": BILLING | {"page_size": "many"}}, "billing.page_size: not an integer"),
        ({"billing": BILLING | {"page_size": 501}}, "billing.page_size: must be ≤ 500"),
        ({"billing": BILLING | {"page_size": 0}}, "billing.page_size: must be ≥ 1"),
        ({"billing": BILLING | {"timeout": "5 minutes"}}, "billing.timeout: not a duration (use e.g. 30s, 5m, 1h)"),
        ({"billing": BILLING | {"usage_interval": "0s"}}, "billing.usage_interval: must be greater than zero"),
        ({"billing": BILLING | {"timezone": "Mars/Olympus"}}, "billing.timezone: unknown time zone 'Mars/Olympus'"),
        ({"billing": BILLING | {"url": "openapi.example.com"}}, "billing.url: must be an http:// or https:// URL"),
        ({"billing": BILLING, "server": {"listen": ":\u0669\u0668\u0667\u0667"}},
         "server.listen: contains characters that are not allowed"),
        ({"billing": BILLING | {"url": "https://:443/"}}, "billing.url: must be an http:// or https:// URL"),
        ({"billing": BILLING, "alerts": {"notifiers": [{"name": "h", "type": "webhook", "url": "http://127.0.0.1:99999/h"}]}},
         "alerts.notifiers[0].url: its port must be a number from 1 to 65535"),
        ({"billing": BILLING, "alerts": {"notifiers": [{"name": "s", "type": "slack", "url": "hooks.slack.com/T/B"}]}},
         "alerts.notifiers[0].url: must be an http:// or https:// URL"),  # (a secret: not shown)
        *(({"billing": BILLING, "alerts": {"notifiers": [{"name": "s", "type": kind, "url": url}]}},
           f"alerts.notifiers[0].url: {problem}")
          for kind, url, problem in [
              ("slack", "https://hooks.slack.com/services/T0 B1/sEcReT", SPACE),
              ("webhook", "https://hooks.example.com/h?token=sEcReT&x=a\tb", SPACE),
              ("webhook", "https://hooks.example.com/höök", "holds a character beyond ASCII outside its host name:"
               " percent-encode it"),
              ("webhook", "https://bot:pässword@hooks.example.com/h", "holds a character beyond ASCII outside its"
               " host name: percent-encode it"),
          ]),  # (HTTP sends none: the URL not shown)
        ({"billing": BILLING, "alerts": {"rules": [
            {"alert": "A", "signal": "spend", "threshold": 1, "annotations": {"runbook-url": "https://runbooks/a"}}]}},
         "alerts.rules[0] (alert A): annotation 'runbook-url' is not a valid annotation name (letters, digits and _,"
         " not starting with a digit): Alertmanager and Prometheus refuse it"),
        ({"billing": BILLING, "alerts": {"rules": [
            {"alert": "A", "signal": "spend", "threshold": 1, "labels": {"__name__": "page"}}]}},
         "alerts.rules[0] (alert A): label '__name__' starts with __, which Prometheus keeps for its own labels"),
        ({"billing": BILLING, "alerts": {"rules": [
            {"alert": "A", "signal": "spend", "threshold": 1, "labels": {"severity\n": "page"}}]}},
         "alerts.rules[0] (alert A): label 'severity\\n' is not a valid alert label name"),
        ({"billing": BILLING, "alerts": {"rules": [
            {"alert": "A", "signal": "spend", "threshold": 1, "annotations": {"summary\n": "x"}}]}},
         "alerts.rules[0] (alert A): annotation 'summary\\n' is not a valid annotation name (letters, digits and _,"
         " not starting with a digit): Alertmanager and Prometheus refuse it"),
        ({"billing": BILLING | {"pagesize": 10}}, "billing.pagesize: unknown key; did you mean page_size?"),
        ({"billing": BILLING, "extra": 1}, "extra: unknown key"),
        ({"billing": BILLING | {"currency": "cny"}},
         "billing.currency: 'cny' is not an ISO 4217 currency code (three upper-case letters, e.g. CNY or USD)"),
        ({"billing": BILLING | {"currency": "YUAN"}},
         "billing.currency: 'YUAN' is not an ISO 4217 currency code (three upper-case letters, e.g. CNY or USD)"),
        ({"billing": BILLING | {"secret_access_key": "${NOT_SET}"}},
         "billing.secret_access_key: environment variable NOT_SET is not set"),
        ({"billing": BILLING, "budgets": [{"name": "m", "amount": "lots"}]},
         "budgets[0].amount (budget 'm'): not a number"),
        ({"billing": BILLING, "budgets": [{"name": "m", "amount": 0}]},
         "budgets[0].amount (budget 'm'): must be greater than zero"),
        ({"billing": BILLING, "probes": [{"name": "p", "model": "ep"}]},
         "inference: required when there are `probes` (url and api_key)"),
        ({"billing": BILLING, "inference": {"url": "http://x", "api_key": "k"},
          "probes": [{"name": "p", "model": "ep", "expect_content": "("}]},
         "probes[0].expect_content: not a valid regular expression (missing ), unterminated subpattern at position 0)"),
        ({"billing": BILLING, "alerts": {"rules": [{"alert": "A", "signal": "cost", "threshold": 1}]}},
         "alerts.rules[0].signal (alert A): must be one of 'spend', 'estimated_spend', 'tokens', 'requests', "
         "'probe_latency', 'probe_success', 'data_age', 'reconciliation_gap' or 'spend_anomaly'"),
        ({"billing": BILLING, "alerts": {"rules": [{"alert": "A", "signal": "spend", "threshold": "x"}]}},
         "alerts.rules[0].threshold (alert A): not a number"),
        ({"billing": BILLING, "alerts": {"rules": [{"alert": "A", "signal": "spend", "threshold": 1,
                                                    "by": ["project_id", "item"]}]}},
         "alerts.rules[0] (alert A): spend by project_id is read from the bills by endpoint, whose lines carry no"
         " item"),
        ({"billing": BILLING, "budgets": [{"name": "m", "amount": 1}],
          "alerts": {"rules": [{"alert": "B", "budget": "m", "tiers": [0.5, 11]}]}},
         "alerts.rules[0].tiers (alert B): tier 11.0 is outside (0, 10]"),
        ({"billing": BILLING, "alerts": {"rules": [{"alert": "C", "signal": "spend", "threshold": 1,
                                                    "annotations": {"summary": "{endpoint_id} high"}}]}},
         "alerts.rules[0] (alert C): annotation 'summary' names unknown field {endpoint_id}"),
        ({"billing": BILLING, "alerts": {"notifiers": [{"name": "n", "type": "sms"}]}},
         "alerts.notifiers[0]: unknown type 'sms' (expected one of 'alertmanager', 'webhook', 'slack', 'pagerduty',"
         " 'email')"),
        ({"billing": BILLING, "alerts": {"notifiers": [{"name": "n", "type": "webhook"}]}},
         "alerts.notifiers[0].url: required key is missing"),
        ({"billing": BILLING, "alerts": {"notifiers": [
            {"name": "mail", "type": "email", "smtp": "smtp.example.com:587", "from": "exporter@example",
             "to": ["ops@example.com"]}]}},
         "alerts.notifiers[0].from: 'exporter@example' is not an email address"),
        ({"billing": BILLING, "alerts": {"notifiers": [
            {"name": "mail", "type": "email", "smtp": "smtp.example.com:587", "from": "exporter@example.com",
             "to": ["Ops <ops@example.com>", "finance"]}]}},
         "alerts.notifiers[0].to[1]: 'finance' is not an email address"),
        ({"billing": BILLING, "alerts": {"notifiers": [
            {"name": "mail", "type": "email", "smtp": "smtp.example.com", "from": "e@example.com",
             "to": ["o@example.com"]}]}},
         "alerts.notifiers[0].smtp: 'smtp.example.com' is not HOST:PORT (e.g. smtp.example.com:587)"),
        ({"billing": BILLING, "alerts": {"notifiers": [
            {"name": "mail", "type": "email", "smtp": "smtp.example.com:25", "from": "e@example.com",
             "to": ["o@example.com"], "username": "u", "password": "${P}", "starttls": False}]}},
         "alerts.notifiers[0]: a login needs `starttls: true`, or port 465 (the password would cross the network"
         " in clear)"),
        ({"billing": BILLING, "digest": {"at": "9:00", "notifiers": ["hook"]},
          "alerts": {"notifiers": [{"name": "hook", "type": "webhook", "url": "http://r/h"}]}},
         "digest.at: '9:00' is not a time of day as HH:MM (00:00 to 23:59)"),
        ({"billing": BILLING, "digest": {"at": "24:00", "notifiers": ["hook"]},
          "alerts": {"notifiers": [{"name": "hook", "type": "webhook", "url": "http://r/h"}]}},
         "digest.at: '24:00' is not a time of day as HH:MM (00:00 to 23:59)"),
        ({"billing": BILLING, "digest": {"notifiers": ["hook", "chat"]},
          "alerts": {"notifiers": [{"name": "hook", "type": "webhook", "url": "http://r/h"}]}},
         "digest.notifiers[1]: unknown notifier 'chat' (those that take digests: hook)"),
        ({"billing": BILLING, "digest": {"notifiers": ["am"]},
          "alerts": {"notifiers": [{"name": "am", "type": "alertmanager", "urls": ["http://am:9093"]}]}},
         "digest.notifiers[0]: 'am' is an Alertmanager: it takes alerts, not a digest"),
        ({"billing": BILLING, "digest": {"notifiers": ["pd"]},
          "alerts": {"notifiers": [{"name": "pd", "type": "pagerduty", "routing_key": "${KEY}"}]}},
         "digest.notifiers[0]: 'pd' is PagerDuty: a digest is not an incident"),
        ({"billing": BILLING, "digest": {"schedule": "hourly", "notifiers": ["x"]}},
         "digest.schedule: must be one of 'daily' or 'weekly'"),
        ({"billing": BILLING, "budgets": [{"name": "b", "amount": 5, "where": {"model": "m"}}]},
         "budgets[0].where.model (budget 'b'): model 'm' has no entry in `prices`"),
        ({"billing": BILLING, "budgets": [{"name": "k", "amount": 5, "where": {"api_key": "sk-ab****"}}],
          "prices": [{"model": "m", "prompt_per_million": 1, "completion_per_million": 2}]},
         "budgets[0].where.api_key (budget 'k'): usage is counted per API key only with `billing.per_api_key: true`"),
        ({"billing": {**BILLING, "per_api_key": True},
          "budgets": [{"name": "k", "amount": 5, "where": {"api_key": "sk-ab****"}}]},
         "budgets[0].where.api_key (budget 'k'): a scope on api_key is priced from `prices`, which is empty"),
        ({"billing": BILLING, "budgets": [{"name": "k", "amount": 5, "where": {"api_key": "sk-abcdef123456"}}]},
         "budgets[0] (budget 'k'): `where.api_key` must be the masked key as usage records show it (a prefix and"
         " asterisks, e.g. sk-ab****): a full key never matches, and does not belong in the config"),
        ({"billing": BILLING, "budgets": [{"name": "t", "amount": 5, "where": {"team": "search"}}]},
         "budgets[0] (budget 't'): `where` cannot name 'team': a budget is scoped on endpoint_id, item, product,"
         " project_id (billed) or model, api_key (usage × prices), and on `account` with `accounts`"),
        ({"billing": BILLING, "budgets": [{"name": "t", "amount": 5, "where": {"endpoint_id": "e", "item": "i"}}]},
         "budgets[0] (budget 't'): `where` names endpoint_id and item: bills are by endpoint or by item, not both"),
        ({"billing": BILLING, "budgets": [{"name": "t", "amount": 5, "where": {"project_id": "p", "item": "i"}}]},
         "budgets[0] (budget 't'): `where` names project_id and item: the bills' lines by item carry no project"),
        ({"billing": BILLING, "budgets": [{"name": "t", "amount": 5, "where": {"model": "m", "product": "p"}}],
          "prices": [{"model": "m", "prompt_per_million": 1, "completion_per_million": 2}]},
         "budgets[0] (budget 't'): `where` mixes usage labels (model, api_key) with billed ones (item, product,"
         " project_id): usage records carry only endpoint_id, model and api_key"),
        ({"billing": {**BILLING, "project_id": "p1"},
          "budgets": [{"name": "t", "amount": 5, "where": {"project_id": "p2"}}]},
         "budgets[0].where.project_id (budget 't'): matches nothing: `billing.project_id` is 'p1'"),
        ({"billing": BILLING, "server": {"basic_auth": {"username": "ops:team", "password": "pw"}}},
         "server.basic_auth.username: a user name cannot hold ':' (a client sends the user name and the password"
         " joined by one)"),
        ({"accounts": [{"name": "cn", "billing": {**BILLING, "currency": "CNY"}},
                       {"name": "us", "billing": {**BILLING, "access_key_id": "AK2", "currency": "USD"}}],
          "budgets": [{"name": "org", "amount": 20000}]},
         "budgets[0] (budget 'org'): spans accounts of different currencies (cn: CNY, us: USD): their spend adds"
         " up to no amount; scope it to accounts of one (`where: {account: [...]}`)"),
    ],
)  # fmt: skip
def test_each_bad_config_gets_its_own_clear_message(document: dict, expected: str) -> None:
    assert expected in errors_of(document)


@pytest.mark.parametrize(
    ("document", "expected"),
    [
        ({"billing": {"url": "https://b", "acess_key_id": "AK", "secret_access_key": "s"}},
         ["billing.access_key_id: required key is missing",
          "billing.acess_key_id: unknown key; did you mean access_key_id?"]),
        ({"billing": BILLING | {"curency": "CNY"}}, ["billing.curency: unknown key; did you mean currency?"]),
        ({"billing": BILLING | {"acess_key_id": "AK"}}, ["billing.acess_key_id: unknown key"]),  # it is there
        ({"billing": BILLING, "inference": {"url": "http://x", "apikey": "k"}},
         ["inference.api_key: required key is missing", "inference.apikey: unknown key; did you mean api_key?"]),
        ({"billing": BILLING, "budget": []}, ["budget: unknown key; did you mean budgets?"]),
        ({"billing": BILLING, "inference": {"url": "http://x", "api_key": "k"},
          "probes": [{"name": "p", "model": "ep", "timout": "5s"}]},
         ["probes[0].timout: unknown key; did you mean timeout?"]),
        ({"billing": BILLING,
          "alerts": {"rules": [{"alert": "A", "signal": "spend", "threshold": 1, "windw": "month"}]}},
         ["alerts.rules[0].windw (alert A): unknown key; did you mean window?"]),
        ({"billing": BILLING, "alerts": {"notifiers": [{"name": "n", "type": "slack", "uri": "http://s"}]}},
         ["alerts.notifiers[0].url: required key is missing",
          "alerts.notifiers[0].uri: unknown key; did you mean url?"]),
        ({"accounts": [{"name": "a", "biling": BILLING}]},
         ["accounts[0].billing: required key is missing", "accounts[0].biling: unknown key; did you mean billing?"]),
        ({"billing": BILLING, "server": {"tls": {"cert": "c.pem", "key_file": "k.pem"}}},
         ["server.tls.cert_file: required key is missing", "server.tls.cert: unknown key; did you mean cert_file?"]),
    ],
)  # fmt: skip
def test_a_misspelt_key_gets_the_keys_spelt_most_like_it(document: dict, expected: list[str]) -> None:
    """From the keys of its own place that are not given already, in one line with its location."""
    assert errors_of(document) == expected


def test_the_inference_url_is_kept_without_v1_however_it_is_written() -> None:
    """OpenAI-style SDKs take the address with `/v1`; the spec's paths start with it. Either way
    the config keeps the base address the probes add `/v1/chat/completions` to."""
    for written, kept in [
        ("https://api.example.com", "https://api.example.com"),
        ("https://api.example.com/", "https://api.example.com"),
        ("https://api.example.com/v1", "https://api.example.com"),
        ("https://api.example.com/v1/", "https://api.example.com"),
        ("https://gateway.example.com/openai/v1", "https://gateway.example.com/openai"),
        ("https://api.example.com/v10", "https://api.example.com/v10"),
        ("https://v1", "https://v1"),  # a host named v1, not a path
    ]:
        config = validate({"billing": BILLING, "inference": {"url": written, "api_key": "k"}}, ENV)
        assert config.inference is not None
        assert config.inference.url == kept, written


def test_an_inference_url_with_a_query_a_fragment_or_a_password_is_refused_without_its_value() -> None:
    """A query would land before the path, and a user name or password would replace the API key
    with basic auth: each refused, naming the part, never what it holds."""
    for written, part in [
        ("https://api.example.com/v1?key=s3cret-in-query", "a query"),
        ("https://api.example.com/#s3cret-in-fragment", "a fragment"),
        ("https://user:s3cret-password@api.example.com/v1", "a user name or password"),
        ("https://api.example.com/v1?", "a query"),
        ("https://api.example.com/v1#", "a fragment"),
    ]:
        details = errors_of({"billing": BILLING, "inference": {"url": written, "api_key": "k"}})
        assert details == [f"inference.url: has {part}: give the base address alone (the API key goes in `api_key`)"]
        assert "s3cret" not in " ".join(details)


def test_a_billing_url_with_a_query_a_fragment_or_a_password_is_refused_without_its_value() -> None:
    """A query would land before the API's paths, and a user name or password would be shown with
    the address in every error about it: each refused, naming the part, never what it holds."""
    for written, part in [
        ("https://billing.example.com/?key=s3cret-in-query", "a query"),
        ("https://billing.example.com/#s3cret-in-fragment", "a fragment"),
        ("https://user:s3cret-password@billing.example.com", "a user name or password"),
        ("https://s3cret-user@billing.example.com", "a user name or password"),
        ("https://billing.example.com/?", "a query"),  # (empty: the paths would still go after it)
        ("https://billing.example.com#", "a fragment"),
        ("https://billing.example.com/#s3cret?in-fragment", "a fragment"),
    ]:
        details = errors_of({"billing": BILLING | {"url": written}})
        assert len(details) == 1
        assert details[0].startswith(f"billing.url: has {part}: give the base address alone")
        assert "s3cret" not in " ".join(details)


def test_the_currency_is_unknown_unless_given() -> None:
    assert validate({"billing": BILLING}, ENV).billing.currency == ""
    assert validate({"billing": BILLING | {"currency": "CNY"}}, ENV).billing.currency == "CNY"


def test_every_error_is_reported_at_once() -> None:
    details = errors_of(
        {"billing": BILLING | {"page_size": 501, "timeout": "soon", "bogus": 1, "secret_access_key": "${NOPE}"}}, {}
    )
    assert details == [
        "billing.secret_access_key: environment variable NOPE is not set",
        "billing.page_size: must be ≤ 500",
        "billing.timeout: not a duration (use e.g. 30s, 5m, 1h)",
        "billing.bogus: unknown key",
    ]


def test_problems_across_sections_come_with_the_others_each_at_its_location(tmp_path: Path) -> None:
    details = errors_of(
        {
            "billing": BILLING,
            "inference": {"url": "http://x", "api_key": "k"},
            "server": {"tls": {"cert_file": str(tmp_path / "missing.pem"), "key_file": str(tmp_path / "k.pem")}},
            "probes": [{"name": "p", "model": "ep"}, {"name": "p", "model": "ep2"}],
            "budgets": [{"name": "m", "amount": 1}, {"name": "m", "amount": 2}],
            "alerts": {
                "notifiers": [{"name": "n", "type": "webhook", "url": "http://a"},
                              {"name": "n", "type": "webhook", "url": "http://b"}],
                "rules": [{"alert": "Old", "signal": "data_age", "where": {"source": "bils"}, "threshold": 60},
                          {"alert": "Over", "budget": "monthly", "tiers": [1]}],
            },
        }
    )  # fmt: skip
    assert details == [
        f"server.tls: file {str(tmp_path / 'missing.pem')!r} does not exist",
        "probes[1].name: probe 'p' is defined twice (first at probes[0])",
        "budgets[1].name: budget 'm' is defined twice (first at budgets[0])",
        "alerts.notifiers[1].name: notifier 'n' is defined twice (first at alerts.notifiers[0])",
        "alerts.rules[0].where.source (alert Old): 'bils' matches nothing (known: bills, probe:p, usage)",
        "alerts.rules[1].budget (alert Over): unknown budget 'monthly'",
    ]


def test_a_host_name_beyond_ascii_is_taken() -> None:
    """Sent in its xn-- form (requests and http.client both write it so)."""
    hook = {"name": "h", "type": "webhook", "url": "https://bücher.example/hook"}
    config = validate({"billing": BILLING, "alerts": {"notifiers": [hook]}}, ENV)
    assert config.alerts.notifiers[0].url == "https://bücher.example/hook"  # type: ignore[union-attr]


def test_messages_never_carry_secret_values() -> None:
    details = errors_of({"billing": BILLING | {"page_size": "top-secret-value"}}, ENV)
    assert not any("top-secret-value" in d for d in details)
    assert "top-secret-value" not in repr(validate({"billing": BILLING}, ENV))


def test_a_secret_quoted_by_a_message_about_another_key_is_masked() -> None:
    """The same ${VAR} filling a secret and a key whose message quotes its value (a time zone, a
    notifier named by a rule): the message masks it, as the log does at a reload."""
    secret = "Zp9Kq2Wx7Lm4"
    document = {
        "billing": BILLING | {"secret_access_key": "${SECRET}", "timezone": "${SECRET}"},
        "alerts": {"rules": [{"alert": "A", "signal": "spend", "threshold": 1, "notifiers": ["${SECRET}"]}]},
    }
    details = errors_of(document, ENV | {"SECRET": secret})
    assert "billing.timezone: unknown time zone '***'" in details
    assert any("'***'" in d and d.startswith("alerts.rules[0]") for d in details), details
    assert not any(secret[:5] in d for d in details)
    for written in ("Zp9K\\q2Wx7Lm4", "Zp9K" * 30):  # (quoted escaped, as repr writes it; cut short at 80)
        (told,) = errors_of({"billing": document["billing"]}, ENV | {"SECRET": written})
        assert told == "billing.timezone: unknown time zone '***'"
    # A short secret standing as a word of its own, unquoted: a notifier named by it, listed as known.
    paged = {"billing": document["billing"] | {"timezone": "UTC"}, "alerts": {
        "notifiers": [{"name": "${PD}", "type": "pagerduty", "routing_key": "${PD}"}],
        "rules": [{"alert": "A", "signal": "spend", "threshold": 1, "notifiers": ["pager"]}]}}  # fmt: skip
    assert errors_of(paged, ENV | {"SECRET": secret, "PD": "R0utingK3y"}) == [
        "alerts.rules[0].notifiers[0] (alert A): unknown notifier 'pager' (known: ***)"
    ]
    # A short word that is a piece of a secret URL is not masked (the notifier mistyped is told).
    slack = {"billing": paged["billing"], "alerts": {
        "notifiers": [{"name": "team-chat", "type": "slack", "url": "https://hooks.slack.com/services/T0/B0/x"}],
        "rules": [{"alert": "A", "signal": "spend", "threshold": 1, "notifiers": ["slack"]}]}}  # fmt: skip
    assert errors_of(slack, ENV | {"SECRET": secret}) == [
        "alerts.rules[0].notifiers[0] (alert A): unknown notifier 'slack' (known: team-chat)"
    ]
    # A placeholder (`rules` run where the credentials are not at hand) masks no piece of a word.
    placeholder = {"billing": document["billing"] | {"timezone": "UTC"}, "alerts": {"rules": [
        {"alert": "LatestSpend", "signal": "spend", "threshold": 1, "notifiers": ["pager"]}]}}  # fmt: skip
    assert errors_of(placeholder, ENV | {"SECRET": "test"}) == [
        "alerts.rules[0].notifiers[0] (alert LatestSpend): unknown notifier 'pager' (known: none)"
    ]


def test_substitution_inside_strings() -> None:
    config = validate({"billing": BILLING | {"url": "https://${HOST}:8443/"}}, ENV | {"HOST": "billing.internal"})
    assert config.billing.url == "https://billing.internal:8443"


@pytest.mark.parametrize(
    ("text", "seconds"), [("30s", 30), ("5m", 300), ("1h30m", 5400), ("500ms", 0.5), (15, 15), ("1d", 86400)]
)
def test_durations(text: object, seconds: float) -> None:
    assert parse_duration(text) == seconds


def test_amounts_stay_decimal() -> None:
    config = validate(
        {"billing": BILLING, "prices": [{"model": "m", "prompt_per_million": 0.1, "completion_per_million": "0.3"}]},
        ENV,
    )
    assert config.prices[0].prompt_per_million == Decimal("0.1")
    assert config.prices[0].completion_per_million == Decimal("0.3")


def test_yaml_errors_name_the_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("billing:\n  url: [unclosed\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:3:1: invalid YAML"):
        load(bad)
    twice = tmp_path / "twice.yaml"
    twice.write_text("billing:\n  url: http://a\n  url: http://b\n")
    with pytest.raises(ConfigError, match=r"twice.yaml:3:3: invalid YAML: key 'url' is given twice"):
        load(twice)
    with pytest.raises(ConfigError, match="cannot read"):
        load(tmp_path / "missing.yaml")
    alias = tmp_path / "alias.yaml"
    for value, problem in (("*S3cret", "found undefined alias"), ("!S3cret", "could not determine a constructor")):
        alias.write_text(f"billing:\n  secret_access_key: {value}\n")  # (a password that starts with * or !)
        with pytest.raises(ConfigError) as refused:
            load(alias)
        (said,) = refused.value.details
        assert said.startswith(f"{alias}:2:22: invalid YAML: {problem}")  # where, so that it can be found
        assert "S3cret" not in said  # but not the name: it may be a secret written by mistake
    for depth, valid in ((600, True), (700, False), (1000, True), (5000, True)):
        # (deeper than the checks or PyYAML's parser can recurse; over libyaml's limit)
        deep = tmp_path / "deep.yaml"
        deep.write_text("billing: " + "[" * depth + "]" * depth + "\n" + "bad: [\n" * (not valid))
        with pytest.raises(ConfigError, match=r"deep.yaml(:\d+:\d+)?: invalid YAML: "):
            load(deep)  # (told, not a RecursionError)
    # As deep through an alias: 90 levels put 90 levels down.
    deep.write_text("p: &p " + "[" * 90 + "]" * 90 + "\nq: " + "[" * 90 + "*p" + "]" * 90 + "\n")
    with pytest.raises(ConfigError, match=r"deep.yaml: invalid YAML: nested too deeply"):
        load(deep)
    latin = tmp_path / "latin.yaml"
    latin.write_bytes("billing:\n  url: http://café\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"latin.yaml: not UTF-8 text \(byte 27 cannot be read\)"):
        load(latin)


def test_the_example_config_is_valid() -> None:
    environ = {"BILLING_ACCESS_KEY_ID": "AK", "BILLING_SECRET_ACCESS_KEY": "s", "INFERENCE_API_KEY": "k"}
    config = load(ROOT / "config.example.yaml", environ)
    names = ["EndpointDailySpendHigh", "MonthlyBudget", "SpendAnomaly", "BillDisagreesWithUsage", "BillsStale"]
    assert [r.alert for r in config.alerts.rules] == names


def test_the_example_config_s_accounts_block_is_valid_once_uncommented(tmp_path: Path) -> None:
    """The several-accounts block the example invites to uncomment, in place of its `billing`."""
    lines = (ROOT / "config.example.yaml").read_text().splitlines()
    start = lines.index("# accounts:")
    block = ["accounts:"]
    for line in lines[start + 1 :]:
        if not line.startswith("#   "):
            break
        block.append(line.removeprefix("# "))
    path = tmp_path / "accounts.yaml"
    path.write_text("\n".join(block) + "\n")
    environ = dict.fromkeys(["PROD_AK", "PROD_SK", "PROD_INFERENCE_KEY", "STAGING_AK", "STAGING_SK"], "x")
    config = load(path, environ)
    assert [account.name for account in config.accounts] == ["prod", "staging"]


def test_an_unquoted_variable_inside_braces_is_told_how_to_write_it(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("billing: {url: https://b, access_key_id: ${AK}, secret_access_key: s}\n")
    with pytest.raises(ConfigError) as raised:
        load(path, {"AK": "a"})
    assert raised.value.details == [
        f"{path}:1:43: invalid YAML: expected ',' or '}}', but got '{{'"
        ' (a ${VAR} inside { } or [ ] is written quoted: "${VAR}")'
    ]


def test_a_variable_s_value_is_trimmed_as_a_secret_file_s_is() -> None:
    """A secret made with `echo` or from a file keeps its line break in the environment: it would
    reach an HTTP header (refused there, the key in the error) or a signature."""
    config = validate({"billing": BILLING}, {"SECRET": " top-secret-value\n"})
    assert config.billing.secret_access_key.get_secret_value() == "top-secret-value"


def test_secrets_from_files(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("from-a-file\n")
    config = validate({"billing": BILLING | {"secret_access_key": f"${{file:{secret}}}"}}, {})
    assert config.billing.secret_access_key.get_secret_value() == "from-a-file"
    missing = errors_of({"billing": BILLING | {"secret_access_key": "${file:/nonexistent/secret}"}}, {})
    assert missing == [
        "billing.secret_access_key: cannot read secret file /nonexistent/secret (No such file or directory)"
    ]
    latin = tmp_path / "latin"
    latin.write_bytes("clé-secrète".encode("latin-1"))
    assert errors_of({"billing": BILLING | {"secret_access_key": f"${{file:{latin}}}"}}, {}) == [
        f"billing.secret_access_key: secret file {latin} is not UTF-8 text"
    ]


def test_secrets_written_in_the_file_get_a_warning(tmp_path: Path) -> None:
    from exporter.config.load import load_checked

    path = tmp_path / "config.yaml"
    path.write_text(
        "billing: {url: 'https://b', access_key_id: AK, secret_access_key: literal-secret}\n"
        "alerts:\n  notifiers:\n"
        "    - {name: chat, type: slack, url: 'https://hooks.example/T/B/token'}\n"
        "    - {name: hook, type: webhook, url: 'http://receiver/hook'}\n"
        "    - {name: pd, type: pagerduty, routing_key: '${PD_KEY}'}\n"
        "    - {name: basic, type: webhook, url: 'https://bot:literal-password@receiver/hook'}\n"
        "    - {name: am, type: alertmanager, urls: ['http://am-0:9093', 'https://am:literal-password@am-1:9093']}\n"
        "    - {name: am-env, type: alertmanager, urls: ['https://am:${AM_PASSWORD}@am-2:9093']}\n"
    )
    path.chmod(0o600)
    _, warnings = load_checked(path, {"PD_KEY": "k", "AM_PASSWORD": "p"})
    assert warnings == [
        "billing.secret_access_key: a secret is written in the config file; use ${VAR} or ${file:PATH}",
        "alerts.notifiers[0].url: a secret is written in the config file; use ${VAR} or ${file:PATH}",
        "alerts.notifiers[3].url: a secret is written in the config file; use ${VAR} or ${file:PATH}",
        "alerts.notifiers[4].urls[1]: a secret is written in the config file; use ${VAR} or ${file:PATH}",
    ]
    assert not any("literal-secret" in w for w in warnings)
    path.chmod(0o644)
    _, warnings = load_checked(path, {"PD_KEY": "k", "AM_PASSWORD": "p"})
    assert warnings[-1] == "the file is world-readable and holds secrets (chmod o-r)"  # the caller names the file
    environ = {"BILLING_ACCESS_KEY_ID": "a", "BILLING_SECRET_ACCESS_KEY": "b", "INFERENCE_API_KEY": "c"}
    assert load_checked(ROOT / "config.example.yaml", environ)[1] == []


@pytest.mark.parametrize(
    ("rule", "expected"),
    [
        ({"alert": "C", "budget": "m", "tiers": [1], "for": "1m"},
         ["alerts.rules[0].for (alert C): does not apply to a budget rule (it fires once per tier per period)"]),
        ({"alert": "D", "signal": "spend", "threshold": 1, "budget": "m"},
         ["alerts.rules[0].budget (alert D): does not apply to a threshold rule (a rule has either `signal` with "
          "`threshold`, or `budget` with `tiers`)"]),
        ({"alert": "E", "signal": "spend", "threshold": 1, "budget": None}, []),
    ],
)  # fmt: skip
def test_a_key_of_the_other_kind_of_rule_says_so(rule: dict, expected: list[str]) -> None:
    document = {"billing": BILLING, "budgets": [{"name": "m", "amount": 1}], "alerts": {"rules": [rule]}}
    if expected:
        assert errors_of(document) == expected
    else:
        assert validate(document, ENV).alerts.rules[0].alert == rule["alert"]


def test_the_secrets_are_the_schema_s_secret_fields_and_a_notifier_s_by_its_type() -> None:
    from exporter.config.schema import Config, secret_fields

    raw = {
        "billing": {"url": "u", "access_key_id": "a", "secret_access_key": "s1"},
        "inference": {"url": "u", "api_key": "s2"},
        "server": {"basic_auth": {"username": "x", "password": "s3"}},
        "alerts": {"notifiers": [
            {"name": "w", "type": "webhook", "url": "not a secret"},
            {"name": "s", "type": "slack", "url": "s4"},
            {"name": "p", "type": "pagerduty", "routing_key": "s5", "url": "not a secret either"},
        ]},
    }  # fmt: skip
    found = dict(secret_fields(Config, raw))
    assert found == {
        ("billing", "secret_access_key"): "s1",
        ("inference", "api_key"): "s2",
        ("server", "basic_auth", "password"): "s3",
        ("alerts", "notifiers", 1, "url"): "s4",
        ("alerts", "notifiers", 2, "routing_key"): "s5",
    }


def test_a_webhook_url_carrying_a_token_written_in_the_file_is_warned_about(tmp_path: Path) -> None:
    from exporter.config.load import load_checked

    path = tmp_path / "config.yaml"
    path.write_text(
        "billing: {url: 'https://openapi.example.com', access_key_id: AK1, secret_access_key: '${SECRET}'}\n"
        "alerts:\n  notifiers:\n"
        "    - {name: a, type: webhook, url: 'https://hooks.slack.com/services/T/B/XXX'}\n"
        "    - {name: b, type: webhook, url: 'https://receiver.example/hook?token=abc'}\n"
        "    - {name: c, type: webhook, url: 'https://receiver.example/hook'}\n"
    )
    path.chmod(0o600)
    config, warnings = load_checked(path, ENV)
    assert warnings == [
        "alerts.notifiers[0].url: a secret is written in the config file; use ${VAR} or ${file:PATH}",
        "alerts.notifiers[1].url: a secret is written in the config file; use ${VAR} or ${file:PATH}",
    ]
    assert {"https://hooks.slack.com/services/T/B/XXX", "token=abc"} <= set(config.secret_values())


def test_a_password_in_any_notifier_s_address_is_a_secret_the_log_masks() -> None:
    notifiers = [
        {"name": "w", "type": "webhook", "url": "https://bot:webhook-pass@receiver.example/hook"},
        {"name": "am", "type": "alertmanager", "urls": ["http://am-0:9093", "https://am:am-pass@am-1:9093"]},
        {"name": "pd", "type": "pagerduty", "routing_key": "${KEY}", "url": "https://pd:pd-pass@events.example/v2"},
    ]
    config = validate({"billing": BILLING, "alerts": {"notifiers": notifiers}}, ENV | {"KEY": "k"})
    assert {"webhook-pass", "am-pass", "pd-pass"} <= set(config.secret_values())


def test_a_mapping_as_a_key_is_a_config_error_with_its_place(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("{{}}")
    with pytest.raises(ConfigError, match=r"config.yaml:1:2: invalid YAML: a key must be a plain value"):
        load(path, ENV)


def test_a_hooks_webhook_s_token_is_masked_as_its_path_too() -> None:
    """A hooks service's URL is its token: masked as written and as its path alone, which is what
    moves when the receiver redirects to https or another host."""
    document = {
        "billing": BILLING,
        "alerts": {"notifiers": [
            {"name": "zap", "type": "webhook", "url": "https://hooks.example.com/catch/123/T0KEN"},
            {"name": "own", "type": "webhook", "url": "https://receiver.example.com/alerts?token=T0KEN2"},
        ]},
    }  # fmt: skip
    secrets = validate(document, {"SECRET": "s"}).secret_values()
    assert "https://hooks.example.com/catch/123/T0KEN" in secrets
    assert "/catch/123/T0KEN" in secrets
    assert "token=T0KEN2" in secrets
    assert "/alerts" not in secrets  # a receiver's own path is no secret


def test_a_login_on_port_465_needs_no_starttls() -> None:
    """Port 465 is TLS from the first byte: the password never crosses in clear there."""
    notifier = {"name": "mail", "type": "email", "smtp": "smtp.example.com:465", "from": "e@example.com",
                "to": ["ops@example.com"], "username": "u", "password": "p", "starttls": False}  # fmt: skip
    config = validate({"billing": BILLING, "alerts": {"notifiers": [notifier]}}, {"SECRET": "s"})
    assert config.alerts.notifiers[0].implicit_tls  # type: ignore[union-attr]


RULE_OF_BUDGET = {"alert": "B", "budget": "monthly", "tiers": [0.5]}


@pytest.mark.parametrize(
    ("document", "expected"),
    [
        ({"budgets": [{"name": "monthly", "amount": "1"}],
          "alerts": {"rules": [RULE_OF_BUDGET | {"budget": ["monthly"]}]}}, "alerts.rules[0].budget"),
        ({"budgets": [{"name": ["monthly"], "amount": "1"}]}, "budgets[0].name"),
        ({"digest": {"notifiers": [{"name": "hook"}]}}, "digest.notifiers[0]"),
        ({"prices": [{"model": ["m"], "prompt_per_million": "1", "completion_per_million": "1"}]}, "prices[0].model"),
        ({"billing": BILLING | {"usage_interval": float("inf")}}, "billing.usage_interval"),
        ({"billing": BILLING | {"usage_interval": float("nan")}}, "billing.usage_interval"),
        ({"billing": BILLING | {"usage_interval": "2000000000d"}}, "billing.usage_interval: longer than 10 years"),
        ({"billing": BILLING | {"timezone": "A" * 300}}, "billing.timezone: unknown time zone"),
        ({"server": {"tls": {"cert_file": "c" * 5000, "key_file": "k.pem"}}}, "server.tls"),
    ],
    ids=["rule budget a list", "budget name a list", "digest notifier a mapping", "price model a list",
         "interval .inf", "interval nan", "interval 2e9 days", "time zone too long", "cert path too long"],
)  # fmt: skip
def test_values_of_the_wrong_kind_or_size_are_errors_not_crashes(document: dict, expected: str) -> None:
    """Each is one error naming its key (they had crashed the checks between sections, or the
    scheduler at start-up, and a reload to them ended the daemon)."""
    full = {"billing": BILLING} | document
    assert any(line.startswith(expected) for line in errors_of(full)), errors_of(full)


@pytest.mark.parametrize("pattern", ["a{4294967296}", "(" * 1000 + "a" + ")" * 1000])
def test_a_pattern_python_cannot_compile_is_an_error(pattern: str) -> None:
    probe = {"name": "p", "model": "m", "expect_content": pattern}
    document = {"billing": BILLING, "inference": {"url": "http://127.0.0.1:1", "api_key": "k"}, "probes": [probe]}
    (error,) = errors_of(document)
    assert error.startswith("probes[0].expect_content")


def test_a_secret_file_name_holding_a_nul_is_an_error() -> None:
    (error,) = errors_of({"billing": BILLING | {"secret_access_key": "${file:/run/sec\x00ret}"}})
    assert error.startswith("billing.secret_access_key: cannot read secret file")


def test_a_config_piped_in_is_read(tmp_path: Path) -> None:
    """`--config /dev/stdin` (or a FIFO someone writes): read to its end, as a file is."""
    pipe = tmp_path / "config.yaml"
    os.mkfifo(pipe)
    text = "billing: {url: 'https://openapi.example.com', access_key_id: AK1, secret_access_key: '${SECRET}'}\n"
    writer = threading.Thread(target=pipe.write_text, args=(text,))
    writer.start()
    try:
        assert load(pipe, ENV).billing.access_key_id == "AK1"
    finally:
        writer.join(10)


def test_a_type_error_leaves_the_other_problems_between_sections_reported() -> None:
    """A list where a budget's name belongs trips the checks between sections that look at names;
    the others still report theirs, in the same run."""
    document = {
        "billing": BILLING,
        "budgets": [{"name": ["monthly"], "amount": "1"}, {"name": "weekly", "amount": "1"},
                    {"name": "weekly", "amount": "2"}],
        "alerts": {"notifiers": [{"name": "pager", "type": "webhook", "url": "https://hooks.example.com/x"}],
                   "rules": [{"alert": "A", "signal": "spend", "threshold": "1", "notifiers": ["pagr"]},
                             {"alert": "Y", "budget": "yearly", "tiers": [0.5]}]},
    }  # fmt: skip
    errors = errors_of(document)
    assert any(e.startswith("budgets[0].name") for e in errors)
    for problem in ("budget 'weekly' is defined twice", "unknown notifier 'pagr'", "unknown budget 'yearly'"):
        assert any(problem in e for e in errors), (problem, errors)


def test_a_mapping_merged_in_with_a_key_written_beside_it_takes_that_key(tmp_path: Path) -> None:
    """YAML's merge key: what is written beside `<<` overrides what it merges in (a key written
    twice by hand is still refused)."""
    path = tmp_path / "config.yaml"
    path.write_text(
        "accounts:\n"
        "  - {name: a, billing: &shared {url: 'https://openapi.example.com', access_key_id: AK1,"
        " secret_access_key: '${SECRET}'}}\n"
        "  - {name: b, billing: {<<: *shared, access_key_id: AK2, url: 'https://other.example.com'}}\n"
    )
    config = load(path, ENV)
    assert [(a.billing.access_key_id, a.billing.url) for a in config.accounts] == [
        ("AK1", "https://openapi.example.com"),
        ("AK2", "https://other.example.com"),
    ]
    for twice in (
        "billing: {url: 'https://a.example.com', url: 'https://b.example.com'}\n",
        "billing: {<<: {url: 'https://a.example.com', url: 'https://b.example.com'}}\n",
        "a: &a {url: 'https://a.example.com'}\nb: &b {url: 'https://b.example.com'}\nbilling: {<<: *a, <<: *b}\n",
    ):
        path.write_text(twice)
        with pytest.raises(ConfigError, match=r"key '(url|<<)' is given twice"):
            load(path, ENV)


def test_an_amount_written_unquoted_is_read_to_its_last_digit(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(
        "billing: {url: 'https://openapi.example.com', access_key_id: AK1, secret_access_key: '${SECRET}'}\n"
        "budgets: [{name: month, amount: 1234567890.123456789}]\n"
        "prices: [{model: m, prompt_per_million: 0.12345678901234567891, completion_per_million: 1.5}]\n"
    )
    config = load(path, ENV)
    assert config.budgets[0].amount == Decimal("1234567890.123456789")
    zero = {"alert": "Z", "signal": "spend", "threshold": "0E+20"}  # (a zero of any exponent is no large amount)
    assert validate({"billing": BILLING, "alerts": {"rules": [zero]}}, ENV).alerts.rules[0].threshold == 0
    assert config.prices[0].prompt_per_million == Decimal("0.12345678901234567891")


def test_mappings_merged_in_many_times_are_looked_at_once_each(monkeypatch: pytest.MonkeyPatch) -> None:
    """An anchor merged in three times at each of 18 levels (a file of some 500 bytes) is checked
    for keys written twice once, not three to the 18th times."""
    from exporter.config import load as load_module

    calls = []
    check = load_module._refuse_repeats
    monkeypatch.setattr(load_module, "_refuse_repeats", lambda *a: calls.append(1) or check(*a))
    inner = "&l0 {x: 1}"
    for level in range(1, 18):
        inner = f"&l{level} {{<<: [{inner}, *l{level - 1}, *l{level - 1}], y{level}: 1}}"
    assert parse_yaml(f"a: {inner}\n")["a"]["x"] == 1
    assert len(calls) < 200


def test_rules_whose_alerts_alertmanager_could_not_tell_apart_are_refused_when_it_takes_both() -> None:
    """Two thresholds of one alert name on two endpoints (`where`), neither with `by`: the engine
    tells their alerts apart, Alertmanager (by labels only) would not, and never notify the second.
    Refused when both go to one `alertmanager` notifier; taken when they cannot collide."""

    def rule(endpoint: str, **more: object) -> dict:
        return {"alert": "EndpointSpendHigh", "signal": "spend", "threshold": 100,
                "where": {"endpoint_id": endpoint}, "labels": {"severity": "page"}} | more  # fmt: skip

    def document(rules: list[dict], notifiers: list[dict]) -> dict:
        return {"billing": BILLING, "alerts": {"rules": rules, "notifiers": notifiers}}

    am = {"name": "am", "type": "alertmanager", "urls": ["http://127.0.0.1:9093"]}
    hook = {"name": "hook", "type": "webhook", "url": "http://127.0.0.1:9/hook"}
    (error,) = errors_of(document([rule("ep-a"), rule("ep-b")], [am, hook]))
    assert error.startswith(
        "alerts.rules[1] (alert EndpointSpendHigh): its alerts can have the same labels as those of alerts.rules[0]"
    )
    assert "Alertmanager (am) tells alerts apart by their labels only" in error
    for fine in (
        document([rule("ep-a"), rule("ep-b")], [hook]),  # (no Alertmanager: the engine tells them apart)
        document([rule("ep-a", notifiers=["hook"]), rule("ep-b", notifiers=["am"])], [am, hook]),  # (not both)
        document([rule("ep-a", by=["endpoint_id"]), rule("ep-b", by=["endpoint_id"])], [am]),  # (their groups differ)
        document([rule("ep-a"), rule("ep-b", labels={"severity": "warn"})], [am]),  # (labels of their own)
    ):
        validate(fine, ENV)
    (error,) = errors_of(document([rule("ep-a", by=["project_id"]), rule("ep-b", by=["project_id"])], [am]))
    assert "alerts.rules[0]" in error  # (both may alert on one project)
    # The first of three goes elsewhere: the other two still collide in Alertmanager, and are told once.
    three = [rule("ep-a", notifiers=["hook"]), rule("ep-b", notifiers=["am"]), rule("ep-c", notifiers=["am"])]
    (error,) = errors_of(document(three, [am, hook]))
    assert error.startswith(
        "alerts.rules[2] (alert EndpointSpendHigh): its alerts can have the same labels as those of alerts.rules[1]"
    )
    # All three to Alertmanager: each later rule is told once, beside the first it is alike.
    told = errors_of(document([rule("ep-a"), rule("ep-b"), rule("ep-c")], [am]))
    assert [error.split(":")[0] for error in told] == [
        "alerts.rules[1] (alert EndpointSpendHigh)",
        "alerts.rules[2] (alert EndpointSpendHigh)",
    ]
    assert all("the same labels as those of alerts.rules[0]" in error for error in told)


def test_a_spend_rule_adding_up_accounts_of_different_currencies_is_refused_unless_split_by_account() -> None:
    accounts = [
        {"name": "cn", "billing": {**BILLING, "currency": "CNY"}},
        {"name": "us", "billing": {**BILLING, "access_key_id": "AK2", "currency": "USD"}},
    ]
    summed = {"alert": "OrgSpendHigh", "signal": "spend", "window": "month", "threshold": 10000}
    assert errors_of({"accounts": accounts, "alerts": {"rules": [summed]}}) == [
        "alerts.rules[0].signal (alert OrgSpendHigh): `spend` adds up accounts of different currencies (cn: CNY,"
        " us: USD), to no amount: split it by account (`by: [account]`) or scope it to accounts of one"
        " (`where: {account: [...]}`)"
    ]
    for taken in ({"by": ["account"]}, {"where": {"account": "cn"}}):
        assert validate({"accounts": accounts, "alerts": {"rules": [summed | taken]}}, ENV).alerts.rules
    budget = {"name": "org", "amount": 5, "where": {"endpoint_id": "ep"}}  # (no `account`: told at the budget)
    assert errors_of({"accounts": accounts, "budgets": [budget]})[0].startswith("budgets[0] (budget 'org'): spans")


def test_a_budget_spanning_accounts_of_one_currency_or_scoped_to_one_is_taken() -> None:
    """Accounts of two currencies: a budget scoped to those of one is taken, as is one spanning an
    account with no currency set (it may be either)."""
    accounts = [
        {"name": "cn", "billing": {**BILLING, "currency": "CNY"}},
        {"name": "us", "billing": {**BILLING, "access_key_id": "AK2", "currency": "USD"}},
        {"name": "cn2", "billing": {**BILLING, "access_key_id": "AK3", "currency": "CNY"}},
        {"name": "other", "billing": {**BILLING, "access_key_id": "AK4"}},
    ]
    budgets = [
        {"name": "china", "amount": 100, "where": {"account": ["cn", "cn2", "other"]}},
        {"name": "us", "amount": 100, "where": {"account": "us"}},
    ]
    config = validate({"accounts": accounts, "budgets": budgets}, ENV)
    assert [b.name for b in config.budgets] == ["china", "us"]


def test_the_log_settings_take_the_command_line_s_spellings_too() -> None:
    """`--log.level warn` and `--log.format logfmt`, as the Prometheus exporters spell them, are
    taken in the config as well: one set of spellings wherever a user writes them."""
    config = validate({"billing": BILLING, "log": {"level": "warn", "format": "logfmt"}}, ENV)
    assert (config.log.level, config.log.format) == ("warning", "text")
    assert errors_of({"billing": BILLING, "log": {"level": "loud"}}) == [
        "log.level: must be one of 'debug', 'info', 'warning' or 'error'"
    ]


@pytest.mark.parametrize("key", ["sk-live-0123\n456789abcdef", "sk-live-0123456789abcdef\u2019", "sk-live-0123\t456"])
def test_an_api_key_no_http_header_can_carry_is_refused_without_its_value(key: str) -> None:
    """A line break inside (a secret of two lines), a curly quote pasted in: the probe's request
    could not be made, and http.client's error quoted the key."""
    document = {"billing": BILLING, "inference": {"url": "http://inference", "api_key": "${KEY}"}}
    errors = errors_of(document, ENV | {"KEY": key})
    assert errors == [
        "inference.api_key: must be printable text an HTTP header can carry: no line break or control character"
        " inside, no character outside Latin-1 (a curly quote pasted in)"
    ]


@pytest.mark.parametrize("key_id", ["AK\u2019", "AK\u00e901", "AK\n1"])
def test_an_access_key_id_but_printable_ascii_is_refused(key_id: str) -> None:
    """It goes into the signature's header: a curly quote pasted in crashed every refresh, and an
    é was signed as UTF-8 but sent as Latin-1 (a server checking the bytes refuses it)."""
    assert errors_of({"billing": BILLING | {"access_key_id": key_id}}) == [
        "billing.access_key_id: must be printable ASCII text (it goes into the request's signed header)"
    ]


def test_a_variable_not_set_under_an_alias_is_told_at_every_place_the_alias_puts_it() -> None:
    """YAML's aliases share one value (it is filled once): what could not be filled in it is still
    told where each alias puts it, as if it were written there."""
    text = """
accounts:
  - name: prod
    billing: &b {url: "http://127.0.0.1:1", access_key_id: AK, secret_access_key: s, page_size: "${PAGE}"}
  - name: staging
    billing: *b
"""
    with pytest.raises(ConfigError) as refused:
        validate(parse_yaml(text), {})
    told = [d for d in refused.value.details if "PAGE" in d]
    assert told == [f"accounts[{n}].billing.page_size: environment variable PAGE is not set" for n in (0, 1)]


def test_every_place_of_the_file_whose_variable_is_not_set_is_told() -> None:
    """However many (a thousand budgets' amounts from the environment): each is told as not set,
    none as the `${VAR}` it holds being no number."""
    document = {"billing": {"url": "http://127.0.0.1:1", "access_key_id": "AK", "secret_access_key": "s"},
                "budgets": [{"name": f"b{n}", "amount": f"${{AMOUNT_{n}}}"} for n in range(1100)]}  # fmt: skip
    with pytest.raises(ConfigError) as refused:
        validate(document, {})
    assert refused.value.details == [
        f"budgets[{n}].amount: environment variable AMOUNT_{n} is not set" for n in range(1100)
    ]
