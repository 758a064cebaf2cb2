"""The `inference-cost-exporter` command."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from exporter import __version__
from exporter.alerts.engine import Alert
from exporter.alerts.promrules import rule_file
from exporter.app.account import RefreshFailed, Sources
from exporter.app.daemon import Daemon, parse_listen
from exporter.app.demo import demo_scenario, demo_traffic
from exporter.billing import BillingClient, BillingError
from exporter.config.load import ConfigError, load_checked
from exporter.config.schema import Config
from exporter.core.clock import PERIOD, Clock
from exporter.core.logs import get_logger, setup_logging
from exporter.delivery.dispatcher import Dispatcher
from exporter.model.snapshots import Latest
from exporter.notifiers.digest import text as digest_text
from exporter.replay.backfill import MAX_MONTHS, BackfillError, backfill, check_range, months, target_labels
from exporter.state import AlertStore, StateError, StateStore, location_problem, peek

if TYPE_CHECKING:
    pass

log = get_logger("exporter")

CONFIG_ENV = "INFERENCE_COST_EXPORTER_CONFIG"
EXIT_CONFIG = 1
EXIT_SOURCE = 2
EXIT_USAGE = 2
SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM, signal.SIGHUP})
REFUSED_KEY = ("http_401", "http_403")


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
    problem = location_problem(config.state.path)
    if problem:  # a warning: the file may be checked on another machine than the one it runs on
        print(
            f"{args.config}: warning: state.path: on this machine no state file can be kept at "
            f"{config.state.path}: {problem}",
            file=sys.stderr,
        )
    digest = config.digest
    sends = f"; digest {digest.schedule} at {digest.at} to {', '.join(digest.notifiers)}" if digest else ""
    print(
        f"{args.config}: valid ({len(config.probes)} probes, {len(config.budgets)} budgets, "
        f"{len(config.alerts.rules)} rules, {len(config.alerts.notifiers)} notifiers{sends})"
    )
    return 0


def cmd_once(args: argparse.Namespace) -> int:
    config = _load(args.config)
    setup_logging(config.log.level, config.log.format, config.secret_values())
    clock = Clock(config.billing.zone)
    latest = Latest()
    sources = Sources(config, latest, clock, StateStore(":memory:"), external_url="")
    try:
        try:
            sources.refresh_once()
        except RefreshFailed as error:
            print(f"inference-cost-exporter: {error}", file=sys.stderr)
            return EXIT_SOURCE
        for name, probe in latest.probes.items():
            if probe.last.reason in REFUSED_KEY:  # a wrong inference key is a config problem, not an outage
                status = probe.last.reason.removeprefix("http_")
                print(f"inference-cost-exporter: probe {name}: the inference API refused the key (HTTP {status}); "
                      "check inference.api_key", file=sys.stderr)  # fmt: skip
                return EXIT_SOURCE
        sys.stdout.write(sources.exposition.render()[0].decode())
    finally:
        sources.close()
    return 0


def cmd_digest(args: argparse.Namespace) -> int:
    config = _load(args.config)
    if args.send and config.digest is None:
        print(f"{args.config}: digest: not configured; `--send` sends through `digest.notifiers`", file=sys.stderr)
        return EXIT_CONFIG
    setup_logging(config.log.level, config.log.format, config.secret_values())
    schedule = config.digest.schedule if config.digest is not None else "daily"
    clock = Clock(config.billing.zone)
    latest = Latest()
    store = StateStore(":memory:")
    sources = Sources(config, latest, clock, store, external_url=config.server.external_url or "")
    try:
        try:
            sources.refresh_once(("bills", "history", "usage"))  # (the probes' runs are the daemon's, below)
        except RefreshFailed as error:
            print(f"inference-cost-exporter: {error}", file=sys.stderr)
            return EXIT_SOURCE
        today = clock.today()
        # The probe runs and firing alerts are the running daemon's, read from its state file.
        held = peek(config.state.path, *sources.digest_span(today, schedule))
        runs, alerts = ([], []) if held is None else (held[0], [Alert(**json.loads(body)) for body in held[1]])
        if held is None:
            print(f"note: no state file at {config.state.path}: no probe runs or alerts to report", file=sys.stderr)
        body = sources.digest(today, schedule, config.server.external_url or "", runs=runs, alerts=alerts)
        sys.stdout.write(digest_text(body))
        if not args.send:
            return 0
        assert config.digest is not None
        # A dispatcher of its own, with the digest's notifiers only and nothing else queued.
        chosen = [n for n in config.alerts.notifiers if n.name in config.digest.notifiers]
        sender = Dispatcher(chosen, AlertStore(store), clock, list, config.server.external_url or "")
        sender.store.enqueue_digest(f"now:{time.time()}", config.digest.notifiers, body, time.time())
        sender.deliver()
        left = sender.pending()
        for name in config.digest.notifiers:
            print(f"{name}: {'not sent' if left.get(name) else 'sent'}", file=sys.stderr)
        return EXIT_SOURCE if any(left.values()) else 0
    finally:
        sources.close()


def cmd_rules(args: argparse.Namespace) -> int:
    config = _load(args.config)
    text, skipped = rule_file(config.alerts, config.budgets)
    for note in skipped:
        print(f"{args.config}: {note}", file=sys.stderr)
    sys.stdout.write(text)
    return 0


def _period(value: str) -> str:
    """`--from` / `--to`: a billing month, YYYY-MM."""
    if not PERIOD.fullmatch(value):
        raise argparse.ArgumentTypeError(f"{value!r} is not a month (YYYY-MM)")
    return value


def cmd_backtest(args: argparse.Namespace) -> int:
    from exporter.replay.backtest import backtest, render

    config = _load(args.config)
    setup_logging(config.log.level, config.log.format, config.secret_values())
    clock = Clock(config.billing.zone)
    last = args.to or clock.period()
    if args.start > last:
        print(f"inference-cost-exporter: backtest: --from {args.start} is after --to {last}", file=sys.stderr)
        return EXIT_USAGE
    if args.start > clock.period():
        print(f"inference-cost-exporter: backtest: --from {args.start} has not begun yet", file=sys.stderr)
        return EXIT_USAGE
    try:
        check_range(args.start, last)
    except ValueError as error:
        print(f"inference-cost-exporter: backtest: {error}", file=sys.stderr)
        return EXIT_USAGE
    try:
        fired, notes = backtest(config, args.start, last, clock)
    except BillingError as error:
        print(f"inference-cost-exporter: backtest: {error}", file=sys.stderr)
        return EXIT_SOURCE
    for note in notes:
        print(f"{args.config}: {note}", file=sys.stderr)
    sys.stdout.write(render(fired, args.format))
    return 0


def cmd_backfill(args: argparse.Namespace) -> int:
    config = _load(args.config)
    setup_logging(config.log.level, config.log.format, config.secret_values())
    clock = Clock(config.billing.zone)
    try:
        periods = months(args.first, args.last, clock.period())
        target = target_labels(args.label)
    except ValueError as error:
        print(f"inference-cost-exporter backfill: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    output = Path(args.output)
    with BillingClient.from_config(config.billing, clock) as client:
        try:
            result = backfill(
                client,
                clock,
                periods,
                output,
                grace_days=config.billing.previous_month_grace_days,
                history=config.billing.history_months > 0,
                target=target,
            )
        except BackfillError as error:
            print(f"inference-cost-exporter backfill: {error}", file=sys.stderr)
            return EXIT_SOURCE
        except OSError as error:
            reason = error.strerror or error
            print(f"inference-cost-exporter backfill: cannot write {output}: {reason}", file=sys.stderr)
            return EXIT_USAGE
    for period, why in result.skipped:
        print(f"inference-cost-exporter backfill: {period} skipped: {why}", file=sys.stderr)
    if not {"job", "instance"} <= {name for name, _ in target}:
        print("inference-cost-exporter backfill: note: Prometheus adds `job` and `instance` to the live series; "
              "without --label job=... --label instance=... as your scrape config sets them, the backfilled "
              "series stay apart from the live ones", file=sys.stderr)  # fmt: skip
    print(
        f"wrote {output}: {', '.join(result.written)}: {result.series:,} series, {result.samples:,} samples "
        f"from {result.start:%Y-%m-%d %H:%M} to {result.end:%Y-%m-%d %H:%M} ({config.billing.timezone}), "
        f"{output.stat().st_size / 1e6:,.1f} MB"
    )
    print(f"load it with: promtool tsdb create-blocks-from openmetrics --max-block-duration=486h {output} DIR")
    return 0


def _hold_signals() -> None:
    """Block SIGINT, SIGTERM and SIGHUP here and, by inheritance, in every thread started after:
    the main thread takes them with `sigwait`. Caught by a handler instead, a signal the kernel
    hands to another thread (the HTTP server's, a refresh's) can leave the main thread asleep."""
    signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)


def _serve_until_signalled(daemon: Daemon) -> int:
    """Run until SIGTERM or SIGINT; SIGHUP reloads the config (signals held by `_hold_signals`)."""
    while (signum := signal.sigwait(SIGNALS)) == signal.SIGHUP:
        daemon.reload()
    log.info("shutting down", signal=signal.Signals(signum).name)
    if not daemon.stop():
        os._exit(0)  # a refresh is stuck in a network call; the state store is transactional, so leave now
    return 0


def _state_problem(error: StateError) -> SystemExit:
    """The state file cannot be used (corrupt, read-only, in use by another exporter): one line, exit 1."""
    print(f"inference-cost-exporter: {error}", file=sys.stderr)
    return SystemExit(EXIT_CONFIG)


def _listen(address: str) -> str:
    """`--listen` or `server.listen`, checked: one line and exit 1 if it is not HOST:PORT."""
    try:
        parse_listen(address)
    except ValueError:
        print(f"inference-cost-exporter: listen address {address!r} is not HOST:PORT "
              "(for example :9877 or 127.0.0.1:9877; the port 0 to 65535)", file=sys.stderr)  # fmt: skip
        raise SystemExit(EXIT_CONFIG) from None
    return address


def _start(daemon_factory: Callable[[], Daemon], listen: str) -> Daemon:
    try:
        daemon = daemon_factory()
    except StateError as error:
        raise _state_problem(error) from None
    except OSError as error:
        print(f"inference-cost-exporter: cannot listen on {listen}: {error.strerror or error}", file=sys.stderr)
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
    listen = _listen(args.listen or config.server.listen)
    if args.reset_state:
        _reset_state(config.state.path)
    _hold_signals()
    daemon = _start(lambda: Daemon(config, config_path=args.config, listen=listen), listen)
    return _serve_until_signalled(daemon)


def cmd_demo(args: argparse.Namespace) -> int:
    setup_logging("info")
    listen = _listen(args.listen)
    _hold_signals()
    sim, sim_server, workdir, config = demo_scenario()
    stop = threading.Event()
    try:
        daemon = _start(lambda: Daemon(config, listen=listen), listen)
        threading.Thread(target=demo_traffic, args=(sim, stop), name="demo-traffic", daemon=True).start()
        url = daemon.server.url
        host = str(daemon.server.server_address[0])
        bound = "every address" if host in ("", "0.0.0.0", "::") else host  # noqa: S104 - display only
        print(
            f"""
inference-cost-exporter demo (Ctrl-C stops it), listening on {bound}, port {daemon.server.server_address[1]!s}
  landing page  {url}/
  metrics       {url}/metrics
  readiness     {url}/readyz
  simulator     {sim_server.url}  (billing and chat API; state in {workdir.name}, removed on exit)
""",
            flush=True,
        )
        return _serve_until_signalled(daemon)
    finally:  # also when the exporter could not start
        stop.set()
        sim_server.stop()
        workdir.cleanup()


def cmd_simulate(args: argparse.Namespace) -> int:
    from exporter.sim import Simulator

    host, port = parse_listen(_listen(args.listen))
    _hold_signals()
    sim = Simulator(latency=args.latency, time_to_first_token=args.ttft, chunk_delay=args.chunk_delay)
    sim.add_usage(args.records)
    server = sim.serve(host or "127.0.0.1", port)
    print(f"simulator at {server.url}", flush=True)
    print(f"  billing:   access_key_id {sim.access_key_id}  secret_access_key {sim.secret_access_key}")
    print(f"  inference: api_key {sim.api_key}  endpoints {', '.join(e.endpoint_id for e in sim.endpoints)}")
    print('  control:   POST /_sim/usage {"count": N}, /_sim/fault {"kind": ...}, /_sim/clear', flush=True)
    signal.sigwait(SIGNALS)
    server.stop()
    return 0


def _command(
    commands: argparse._SubParsersAction[argparse.ArgumentParser], name: str, summary: str, description: str
) -> argparse.ArgumentParser:
    return commands.add_parser(
        name, help=summary, description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )


def _config_option(command: argparse.ArgumentParser) -> None:
    default = os.environ.get(CONFIG_ENV)
    command.add_argument(
        "--config",
        metavar="FILE",
        required=default is None,
        default=default,
        help=f"the YAML config file (or set {CONFIG_ENV})",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="inference-cost-exporter",
        description="Prometheus exporter for an LLM inference account's bills, token usage and endpoints.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    check = _command(
        commands, "check", "validate a config: every problem with its location (exit 1), or a summary (exit 0)",
        "Validate a config file without contacting any API. Prints every problem, one per line, with its "
        "location (e.g. `alerts.rules[2].threshold: not a number`) and exits 1; or prints a one-line summary "
        "(probes, budgets, rules, notifiers) and exits 0. Warns about secrets written in the file itself.",
    )  # fmt: skip
    _config_option(check)
    check.set_defaults(func=cmd_check)

    once = _command(
        commands, "once", "refresh every source once and print the exposition on stdout",
        "Refresh every source once (bills, usage, each probe) and print the metrics exposition on stdout. "
        "Exits 1 for a bad config, 2 when an API refuses or cannot be reached (or refuses the inference key), "
        "with a one-line reason on stderr.",
    )  # fmt: skip
    _config_option(once)
    once.set_defaults(func=cmd_once)

    run = _command(
        commands, "run", "the daemon: scheduled refreshes, /metrics, alerts",
        "Run the exporter: refresh every source on its interval, serve /metrics, the landing page and health, "
        "evaluate alert rules and deliver notifications. SIGHUP reloads the config; SIGTERM or SIGINT stop it.",
    )  # fmt: skip
    _config_option(run)
    run.add_argument("--listen", metavar="ADDR", help="overrides server.listen, e.g. :9877 or 127.0.0.1:9877")
    run.add_argument(
        "--reset-state",
        action="store_true",
        help="if the state file is corrupt, keep it as <path>.corrupt-TIMESTAMP and start with a fresh one",
    )
    run.set_defaults(func=cmd_run)

    digest = _command(
        commands, "digest", "print the digest of the day before (or send it now)",
        "Fetch the bills (and history and usage) now and print the digest the daemon sends at `digest.at`: "
        "yesterday's spend against its expected amount, month to date, forecast, budgets, top endpoints and items, "
        "anomalies, reconciliation gaps, and, from the daemon's state file when there is one, its firing alerts and "
        "each probe's success ratio and p95 time to first token. With --send, also send it now through "
        "`digest.notifiers` (once, without retries; this does not count as the daemon's digest of the day). Exits 1 "
        "for a bad config, 2 when an API refuses or a notifier does not take it.",
    )  # fmt: skip
    _config_option(digest)
    digest.add_argument("--send", action="store_true", help="send it through digest.notifiers too")
    digest.set_defaults(func=cmd_digest)

    rules = _command(
        commands, "rules", "the YAML alert rules as a Prometheus alerting-rule file",
        "Print the config's alert rules as a Prometheus alerting-rule file over this exporter's metrics, for "
        "teams that evaluate alerts in Prometheus. Rules only the exporter can compute are skipped with a note.",
    )  # fmt: skip
    _config_option(rules)
    rules.set_defaults(func=cmd_rules)

    replay = _command(
        commands, "backtest", "replay the bill-based alert rules over past months: what would have fired, when",
        "Fetch the months' daily bills (and the history months before them) and replay every rule judged from "
        "bills (spend thresholds, budgets with tiers, spend_anomaly) day by day, as the daemon would have; print "
        "each alert that would have fired, once, on the day it would have. Exits 1 for a bad config, 2 when the "
        f"API refuses or cannot be reached or the months make no sense (or are more than {MAX_MONTHS}).",
    )  # fmt: skip
    _config_option(replay)
    replay.add_argument("--from", dest="start", required=True, type=_period, metavar="YYYY-MM", help="first month")
    replay.add_argument("--to", type=_period, metavar="YYYY-MM", help="last month (default: the current one)")
    replay.add_argument("--format", choices=("text", "json"), default="text", help="text, or JSON lines")
    replay.set_defaults(func=cmd_backtest)

    backfill_command = _command(
        commands, "backfill", "past months' bill series as OpenMetrics, for promtool to load into Prometheus",
        "Fetch the daily bills of the months --from ... --to and write the series the exporter exposes from them, "
        "with timestamps every 5 minutes as a Prometheus scraping it would have stored them, as OpenMetrics text for "
        "`promtool tsdb create-blocks-from openmetrics FILE DIR`. Only complete days (of this month: before today). "
        "A month the API refuses or lists nothing for is skipped and said. Exits 2 for a bad --from, --to, --label "
        "or --output, and when nothing could be written.",
    )  # fmt: skip
    _config_option(backfill_command)
    backfill_command.add_argument("--from", dest="first", required=True, metavar="YYYY-MM", help="the first month")
    backfill_command.add_argument(
        "--to", dest="last", metavar="YYYY-MM", help="the last month (when not given: this month, its complete days)"
    )
    backfill_command.add_argument(
        "--output", required=True, metavar="FILE", help="the file to write (replaced when complete)"
    )
    backfill_command.add_argument(
        "--label",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a label your Prometheus adds to the exporter's series (job, instance); repeat for each",
    )
    backfill_command.set_defaults(func=cmd_backfill)

    demo = _command(
        commands, "demo", "the embedded simulator and the daemon, no credentials needed",
        "Start the stand-in billing and chat service on loopback and the exporter against it, with growing "
        "usage and an occasional failing chat request, and print the URLs.",
    )  # fmt: skip
    demo.add_argument("--listen", default="127.0.0.1:9877", metavar="ADDR", help="where the exporter listens")
    demo.set_defaults(func=cmd_demo)

    simulate = _command(
        commands, "simulate", "run the stand-in service alone",
        "Run the stand-in billing and chat service alone, to point an exporter or a dashboard at it. Its "
        "credentials are printed; POST /_sim/usage, /_sim/fault and /_sim/clear control it.",
    )  # fmt: skip
    simulate.add_argument("--listen", default="127.0.0.1:9878", metavar="ADDR", help="where it listens")
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
