"""The `inference-cost-exporter` command."""

from __future__ import annotations

import argparse
import logging
import os
import queue
import random
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from exporter import __version__
from exporter.alerts.promrules import rule_file
from exporter.billing import BillingError
from exporter.clock import Clock
from exporter.config import Config, ConfigError, load, load_checked
from exporter.daemon import Daemon, Sources, parse_listen
from exporter.logs import setup_logging
from exporter.snapshots import Latest
from exporter.state import StateError, StateStore

if TYPE_CHECKING:
    from exporter.simulator import Simulator

log = logging.getLogger("exporter")

DEMO_CONFIG = Path(__file__).with_name("demo.yaml")
EXIT_CONFIG = 1
EXIT_SOURCE = 2


def _load(path: str) -> Config:
    try:
        config, warnings = load_checked(path)
    except ConfigError as error:
        for detail in error.details:
            print(f"{path}: {detail}" if not detail.startswith(path) else detail, file=sys.stderr)
        raise SystemExit(EXIT_CONFIG) from None
    for warning in warnings:
        print(f"{path}: warning: {warning}", file=sys.stderr)
    return config


def cmd_check(args: argparse.Namespace) -> int:
    config = _load(args.config)
    print(
        f"{args.config}: valid ({len(config.probes)} probes, {len(config.budgets)} budgets, "
        f"{len(config.alerts.rules)} rules, {len(config.alerts.notifiers)} notifiers)"
    )
    return 0


def cmd_once(args: argparse.Namespace) -> int:
    config = _load(args.config)
    setup_logging(config.log.level, config.log.format, config.secret_values())
    clock = Clock(config.billing.zone)
    latest = Latest()
    sources = Sources(config, latest, clock, StateStore(":memory:"), external_url="")
    try:
        for name, refresh in sources.refreshers.items():
            started = time.perf_counter()
            try:
                refresh()
            except BillingError as error:
                print(f"inference-cost-exporter: {name}: {error}", file=sys.stderr)
                return EXIT_SOURCE
            latest.record(name, success=True, at=time.time(), duration=time.perf_counter() - started)
        sys.stdout.write(sources.exposition.render()[0].decode())
    finally:
        sources.close()
    return 0


def cmd_rules(args: argparse.Namespace) -> int:
    config = _load(args.config)
    text, skipped = rule_file(config.alerts, config.budgets)
    for note in skipped:
        print(f"{args.config}: {note}", file=sys.stderr)
    sys.stdout.write(text)
    return 0


def _serve_until_signalled(daemon: Daemon) -> int:
    """Run until SIGTERM or SIGINT; SIGHUP reloads the config."""
    events: queue.SimpleQueue[int] = queue.SimpleQueue()
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, lambda signum, frame: events.put(signum))
    while (signum := events.get()) == signal.SIGHUP:
        daemon.reload()
    log.info("shutting down signal=%s", signal.Signals(signum).name)
    if not daemon.stop():
        os._exit(0)  # a refresh is stuck in a network call; the state store is transactional, so leave now
    return 0


def _state_problem(error: StateError) -> SystemExit:
    """The state file cannot be used (corrupt, read-only, in use by another exporter): one line, exit 1."""
    print(f"inference-cost-exporter: {error}", file=sys.stderr)
    return SystemExit(EXIT_CONFIG)


def _start(daemon_factory: Callable[[], Daemon]) -> Daemon:
    try:
        daemon = daemon_factory()
    except StateError as error:
        raise _state_problem(error) from None
    except OSError as error:
        print(f"inference-cost-exporter: cannot listen: {error.strerror or error}", file=sys.stderr)
        raise SystemExit(EXIT_CONFIG) from None
    daemon.start()
    return daemon


def _reset_state(path: str) -> None:
    """`--reset-state`: move a corrupt state file aside now (the daemon then opens the fresh one)."""
    try:
        StateStore(path, reset=True).close()
    except StateError as error:
        raise _state_problem(error) from None


def cmd_run(args: argparse.Namespace) -> int:
    config = _load(args.config)
    setup_logging(config.log.level, config.log.format, config.secret_values())
    if args.reset_state:
        _reset_state(config.state.path)
    daemon = _start(lambda: Daemon(config, config_path=args.config, listen=args.listen))
    return _serve_until_signalled(daemon)


def _demo_traffic(sim: Simulator, stop: threading.Event) -> None:
    """Keep today's usage growing, so the counters move while you watch; now and then a chat
    request fails, so the probe failure panels have something to show."""
    from exporter.simulator import Fault

    rng = random.Random(7)
    tick = 0
    while not stop.wait(2.0):
        tick += 1
        sim.add_usage(rng.randint(5, 60))
        if tick % 8 == 0:
            sim.inject(Fault("status", "/v1/chat/completions", status=rng.choice((429, 502, 503))))


def cmd_demo(args: argparse.Namespace) -> int:
    from exporter.simulator import Simulator

    setup_logging("info")
    sim = Simulator(time_to_first_token=0.05, chunk_delay=0.01)
    sim.add_usage(20_000)
    sim_server = sim.serve("127.0.0.1", 0)
    workdir = tempfile.mkdtemp(prefix="inference-cost-exporter-demo-")
    config = load(
        DEMO_CONFIG,
        {
            "SIM_URL": sim_server.url,
            "SIM_ACCESS_KEY_ID": sim.access_key_id,
            "SIM_SECRET_ACCESS_KEY": sim.secret_access_key,
            "SIM_API_KEY": sim.api_key,
            "STATE_DIR": workdir,
        },
    )
    daemon = _start(lambda: Daemon(config, listen=args.listen))
    stop = threading.Event()
    threading.Thread(target=_demo_traffic, args=(sim, stop), name="demo-traffic", daemon=True).start()
    url = daemon.server.url
    print(
        f"""
inference-cost-exporter demo (Ctrl-C stops it)
  landing page  {url}/
  metrics       {url}/metrics
  readiness     {url}/readyz
  simulator     {sim_server.url}  (billing and chat API; state in {workdir})
""",
        flush=True,
    )
    try:
        return _serve_until_signalled(daemon)
    finally:
        stop.set()
        sim_server.stop()


def cmd_simulate(args: argparse.Namespace) -> int:
    from exporter.simulator import Simulator

    host, port = parse_listen(args.listen)
    sim = Simulator(latency=args.latency, time_to_first_token=args.ttft, chunk_delay=args.chunk_delay)
    sim.add_usage(args.records)
    server = sim.serve(host or "127.0.0.1", port)
    print(f"simulator at {server.url}", flush=True)
    print(f"  billing:   access_key_id {sim.access_key_id}  secret_access_key {sim.secret_access_key}")
    print(f"  inference: api_key {sim.api_key}  endpoints {', '.join(e.endpoint_id for e in sim.endpoints)}")
    print('  control:   POST /_sim/usage {"count": N}, /_sim/fault {"kind": ...}, /_sim/clear', flush=True)
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    stop.wait()
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

    run = commands.add_parser("run", help="the daemon: scheduled refreshes, /metrics, alerts")
    run.add_argument("--config", required=True, metavar="FILE")
    run.add_argument("--listen", metavar="ADDR", help="overrides server.listen, e.g. :9877 or 127.0.0.1:9877")
    run.add_argument(
        "--reset-state",
        action="store_true",
        help="if the state file is corrupt, keep it as <path>.corrupt-TIMESTAMP and start with a fresh one",
    )
    run.set_defaults(func=cmd_run)

    rules = commands.add_parser("rules", help="the YAML alert rules as a Prometheus alerting-rule file")
    rules.add_argument("--config", required=True, metavar="FILE")
    rules.set_defaults(func=cmd_rules)

    demo = commands.add_parser("demo", help="the embedded simulator and the daemon, no credentials needed")
    demo.add_argument("--listen", default=":9877", metavar="ADDR")
    demo.set_defaults(func=cmd_demo)

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
