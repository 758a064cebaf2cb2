"""Logs machines can read: logfmt (`text`) and JSON lines, the same fields in both.

The daemon runs as a process with debug logging (so libraries log too), goes through a reload, a
failing source and a recovery, and every line it writes is parsed.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import re
import signal
from pathlib import Path

import pytest
import yaml

from exporter.core.logs import JsonFormatter, LogfmtFormatter, MaskingFormatter, get_logger, setup_logging
from exporter.sim import Fault, Simulator, SimulatorServer
from tests.helpers import scrape, value, wait_for
from tests.test_cli import ready, run, spawn, write_config

PAIR = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|[^\s"=]*)(?: |$)')
RFC3339_MS = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z")


def parse_logfmt(line: str) -> dict[str, str]:
    """A logfmt line as a mapping; fails on anything that is not key=value pairs to the end."""
    fields, at = {}, 0
    while at < len(line):
        match = PAIR.match(line, at)
        assert match, f"not logfmt at {at}: {line!r}"
        raw = match[2]
        fields[match[1]] = json.loads(raw) if raw.startswith('"') else raw
        at = match.end()
    return fields


def run_and_collect(tmp_path: Path, live: tuple[Simulator, SimulatorServer], fmt: str) -> list[str]:
    sim, server = live
    config = write_config(tmp_path, sim, server, log_level="debug", state=tmp_path / "state.db", usage_interval="300ms")
    document = yaml.safe_load(config.read_text())
    document["log"]["format"] = fmt
    config.write_text(yaml.safe_dump(document))
    process, url = spawn("run", "--config", str(config), env={"TEST_BILLING_SECRET": sim.secret_access_key})
    try:
        wait_for(lambda: ready(url), timeout=30)
        process.send_signal(signal.SIGHUP)
        sim.inject(Fault("status", "/api/v1/usages/details", status=503, times=1000))
        wait_for(lambda: value(scrape(url), "inference_exporter_refresh_success", source="usage") == 0, timeout=30)
        sim.clear_faults()
        wait_for(lambda: value(scrape(url), "inference_exporter_refresh_success", source="usage") == 1, timeout=30)
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=20)
    finally:
        process.kill()
    return stderr.splitlines()


@pytest.mark.integration  # the daemon as a process
def test_every_text_line_is_logfmt(tmp_path: Path, live: tuple[Simulator, SimulatorServer]) -> None:
    lines = run_and_collect(tmp_path, live, "text")
    parsed = [parse_logfmt(line) for line in lines]
    assert len(parsed) > 20
    for entry in parsed:
        assert list(entry)[:4] == ["ts", "level", "component", "msg"]
        assert RFC3339_MS.fullmatch(entry["ts"])
        assert entry["level"] in ("debug", "info", "warning", "error")
    failed = [e for e in parsed if e["msg"] == "refresh failed"]
    assert [(e["source"], e["level"]) for e in failed] == [("usage", "error")]
    assert "HTTP 503" in failed[0]["error"]
    assert any(e["msg"] == "config reloaded" and e["path"].endswith("config.yaml") for e in parsed)
    assert any(e["component"].startswith("urllib3") for e in parsed)  # libraries' lines are logfmt too


@pytest.mark.integration  # the daemon as a process
def test_every_json_line_is_an_object_with_its_fields_as_keys(
    tmp_path: Path, live: tuple[Simulator, SimulatorServer]
) -> None:
    parsed = [json.loads(line) for line in run_and_collect(tmp_path, live, "json")]
    assert len(parsed) > 20
    for entry in parsed:
        assert isinstance(entry, dict)
        assert RFC3339_MS.fullmatch(entry["ts"])
        assert {"ts", "level", "component", "msg"} <= set(entry)
    (failed,) = [e for e in parsed if e["msg"] == "refresh failed"]
    assert failed["source"] == "usage"
    assert failed["level"] == "error"
    recovered = [e for e in parsed if e["msg"] == "refresh recovered"]
    assert [e["source"] for e in recovered] == ["usage"]


@pytest.mark.parametrize(
    "value",
    ["plain", "with space", "", 'a "quote"', "key=value", "back\\slash", "two\nlines", "tab\there", "ünïcode"],
)
def test_any_value_survives_both_formats(value: str) -> None:
    record = logging.LogRecord("exporter.test", logging.INFO, __file__, 1, "a message", None, None)
    record.fields = {"field": value, "count": 3, "labels": {"endpoint_id": "ep-1", "severity": "page"}}
    line = LogfmtFormatter().format(record)
    assert "\n" not in line
    parsed = parse_logfmt(line)
    assert (parsed["msg"], parsed["field"], parsed["count"]) == ("a message", value, "3")
    assert parsed["labels"] == "endpoint_id=ep-1,severity=page"
    entry = json.loads(JsonFormatter().format(record))
    assert (entry["field"], entry["count"], entry["labels"]["severity"]) == (value, 3, "page")
    assert dt.datetime.fromisoformat(entry["ts"]).tzinfo is not None


def test_fields_named_like_the_line_s_own_keys_do_not_replace_them(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="exporter.test")
    get_logger("exporter.test").info("hello", ts="not a time", component="other", source="usage")
    (record,) = caplog.records
    entry = json.loads(JsonFormatter().format(record))
    assert entry == entry | {"msg": "hello", "level": "info", "component": "exporter.test", "source": "usage"}
    assert (entry["field_ts"], entry["field_component"]) == ("not a time", "other")
    assert RFC3339_MS.fullmatch(entry["ts"])


@pytest.mark.parametrize("formatter", [LogfmtFormatter(), JsonFormatter()], ids=["text", "json"])
def test_a_secret_is_masked_however_the_format_escapes_it(formatter: logging.Formatter) -> None:
    from exporter.core.logs import MaskingFormatter

    secret = 'pa"ss\\word\x0bx'
    masking = MaskingFormatter(formatter, [secret])
    record = logging.LogRecord("exporter.test", logging.INFO, __file__, 1, f"bad key {secret}", None, None)
    record.fields = {"detail": f"sent {secret} twice", "plain": secret}
    line = masking.format(record)
    assert "pa" not in line.replace("plain", "")  # no piece of it, escaped or not
    assert line.count("***") == 3


@pytest.mark.parametrize("formatter", [LogfmtFormatter(), JsonFormatter()], ids=["text", "json"])
def test_a_secret_with_a_line_break_at_its_end_is_masked_as_an_error_quotes_it(formatter: logging.Formatter) -> None:
    """A library's error quotes a value with its line break escaped (`b'Bearer key\\n'`): the
    secret's ends never hide the rest of it."""
    secret = "sk-live-0123456789\n"
    masking = MaskingFormatter(formatter, [secret])
    message = f"Invalid header value {('Bearer ' + secret).encode()!r}"
    record = logging.LogRecord("exporter.test", logging.ERROR, __file__, 1, message, None, None)
    assert "0123456789" not in masking.format(record)


@pytest.mark.parametrize(
    ("level", "fmt", "expected"),
    [
        ("warn", "logfmt", (logging.WARNING, LogfmtFormatter)),  # promlog's spellings (--log.level, --log.format)
        ("warning", "text", (logging.WARNING, LogfmtFormatter)),  # the config's
        ("debug", "json", (logging.DEBUG, JsonFormatter)),
        ("error", "logfmt", (logging.ERROR, LogfmtFormatter)),
    ],
)
def test_either_spelling_of_a_level_and_a_format(level: str, fmt: str, expected: tuple[int, type]) -> None:
    root = logging.getLogger()
    handlers, before = list(root.handlers), root.level
    try:
        setup_logging(level, fmt)
        [handler] = root.handlers
        assert isinstance(handler.formatter, MaskingFormatter)
        assert (root.level, type(handler.formatter.inner)) == expected
    finally:
        root.handlers[:] = handlers
        root.setLevel(before)
    with pytest.raises(ValueError, match="'verbose'"):
        setup_logging("verbose", fmt)


@pytest.mark.integration  # a command as a process
def test_the_log_flags_override_the_config(tmp_path: Path, live: tuple[Simulator, SimulatorServer]) -> None:
    sim, server = live
    config = write_config(tmp_path, sim, server)  # level info, format text
    env = {"TEST_BILLING_SECRET": sim.secret_access_key}
    result = run("once", "--config", str(config), "--log.level", "debug", "--log.format", "json", env=env)
    assert result.returncode == 0, result.stderr
    parsed = [json.loads(line) for line in result.stderr.splitlines()]
    assert any(entry["level"] == "debug" for entry in parsed)

    document = yaml.safe_load(config.read_text())
    document["log"] = {"level": "debug", "format": "json"}
    config.write_text(yaml.safe_dump(document))
    result = run("once", "--config", str(config), "--log.level", "warn", "--log.format", "logfmt", env=env)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""  # the config's debug lines, held back by --log.level warn
    invalid = run("once", "--config", str(config), "--log.level", "verbose", env=env)
    assert invalid.returncode == 2
    assert "argument --log.level: invalid choice: 'verbose'" in invalid.stderr
