"""The `inference-cost-exporter` command."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import time
from collections.abc import Sequence

from prometheus_client import CollectorRegistry, generate_latest

from exporter import __version__
from exporter.billing import BillingClient, BillingError
from exporter.bills import BillsSource
from exporter.clock import Clock
from exporter.collectors import BillsCollector, BudgetCollector, ExporterCollector, UsageCollector
from exporter.config import Config, ConfigError, load
from exporter.snapshots import Latest
from exporter.usage_sync import UsageSource

log = logging.getLogger("exporter")

EXIT_CONFIG = 1
EXIT_SOURCE = 2


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S%z"),
            "level": record.levelname.lower(),
            "component": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup_logging(level: str = "info", fmt: str = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        JsonFormatter()
        if fmt == "json"
        else logging.Formatter("ts=%(asctime)s level=%(levelname)s component=%(name)s msg=%(message)s")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def parse_listen(address: str) -> tuple[str, int]:
    """`:9877`, `127.0.0.1:9877` or `[::1]:9877` → (host, port); an empty host means every address."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"listen address {address!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def registry_for(config: Config, latest: Latest, clock: Clock) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(BillsCollector(latest))
    registry.register(UsageCollector(latest, clock, config.billing.per_api_key))
    registry.register(BudgetCollector(latest, config.budgets))
    registry.register(ExporterCollector(latest, clock))
    return registry


def _load(path: str) -> Config:
    try:
        return load(path)
    except ConfigError as error:
        for detail in error.details:
            print(f"{path}: {detail}" if not detail.startswith(path) else detail, file=sys.stderr)
        raise SystemExit(EXIT_CONFIG) from None


def cmd_check(args: argparse.Namespace) -> int:
    config = _load(args.config)
    print(
        f"{args.config}: valid ({len(config.probes)} probes, {len(config.budgets)} budgets, "
        f"{len(config.alerts.rules)} rules, {len(config.alerts.notifiers)} notifiers)"
    )
    return 0


def cmd_once(args: argparse.Namespace) -> int:
    config = _load(args.config)
    setup_logging(config.log.level, config.log.format)
    clock = Clock(config.billing.zone)
    latest = Latest()
    with BillingClient.from_config(config.billing, clock, latest.count_api_call) as client:
        sources = {
            "bills": BillsSource(client, clock, config.billing.previous_month_grace_days),
            "usage": UsageSource(client, clock, per_api_key=config.billing.per_api_key, prices=config.prices),
        }
        for name, source in sources.items():
            started = time.time()
            try:
                setattr(latest, name, source.refresh())
            except BillingError as error:
                print(f"inference-cost-exporter: {name}: {error}", file=sys.stderr)
                return EXIT_SOURCE
            latest.record(name, success=True, started=started, finished=time.time())
    sys.stdout.write(generate_latest(registry_for(config, latest, clock)).decode())
    return 0


def _wait_for_signal() -> None:
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    stop.wait()


def cmd_simulate(args: argparse.Namespace) -> int:
    from exporter.simulator import Simulator

    host, port = parse_listen(args.listen)
    sim = Simulator(latency=args.latency, time_to_first_token=args.ttft, chunk_delay=args.chunk_delay)
    sim.add_usage(args.records)
    server = sim.serve(host or "127.0.0.1", port)
    print(f"simulator at {server.url}", flush=True)
    print(
        f"  billing:   url {server.url}  access_key_id {sim.access_key_id}  secret_access_key {sim.secret_access_key}"
    )
    endpoints = ", ".join(e.endpoint_id for e in sim.endpoints)
    print(f"  inference: url {server.url}  api_key {sim.api_key}  endpoints {endpoints}")
    print('  control:   POST /_sim/usage {"count": N}, /_sim/fault {"kind": ...}, /_sim/clear', flush=True)
    try:
        _wait_for_signal()
    finally:
        server.stop()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="inference-cost-exporter",
        description="Prometheus exporter for an LLM inference account's bills, token usage and endpoints.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    check = commands.add_parser("check", help="validate a config, print every error (exit 1) or nothing (exit 0)")
    check.add_argument("--config", required=True, metavar="FILE")
    check.set_defaults(func=cmd_check)

    once = commands.add_parser("once", help="refresh every source once and print the exposition on stdout")
    once.add_argument("--config", required=True, metavar="FILE")
    once.set_defaults(func=cmd_once)

    simulate = commands.add_parser("simulate", help="run the stand-in service alone")
    simulate.add_argument("--listen", default="127.0.0.1:9878", metavar="ADDR")
    simulate.add_argument("--records", type=int, default=2000, help="usage records for today")
    simulate.add_argument("--latency", type=float, default=0.0, help="seconds added to every request")
    simulate.add_argument("--ttft", type=float, default=0.05, help="chat time to first token, seconds")
    simulate.add_argument("--chunk-delay", type=float, default=0.01, help="seconds between streamed chunks")
    simulate.set_defaults(func=cmd_simulate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
