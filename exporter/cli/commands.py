"""What the commands that fetch, serve or replay do (`once`, `digest`, `backtest`, `backfill`, `run`,
`demo`, `simulate`): their work, output and exit status. (`check` and `rules` only read a config:
`config_commands`, which starts without what these import.)"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from exporter.alerts.alert import saved_alerts
from exporter.app.account import account_ids
from exporter.app.daemon import SHUTDOWN_GRACE, Daemon, parse_listen
from exporter.app.demo import demo_scenario, demo_traffic
from exporter.app.digests import FiringByAccount
from exporter.app.sources import RefreshFailed, Sources, account_state_path
from exporter.billing import BillingClient, BillingError
from exporter.cli.config_commands import EXIT_CONFIG, EXIT_SOURCE, EXIT_USAGE, chosen_accounts, load_config
from exporter.config.schema import Config
from exporter.core.clock import Clock
from exporter.core.logs import get_logger, setup_logging
from exporter.delivery.dispatcher import Dispatcher
from exporter.model.snapshots import Latest
from exporter.notifiers.digest import text as digest_text
from exporter.replay.backfill import BackfillError, backfill, check_range, months, target_labels
from exporter.replay.focus import FocusError, MissingCurrency, export
from exporter.sources.probe import unusable
from exporter.state import AlertStore, StateError, StateStore, peek, peek_account_files
from exporter.state.accounts import files_for
from exporter.web import WebConfigError

log = get_logger("exporter")

SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM, signal.SIGHUP})


def _logging(args: argparse.Namespace, level: str = "", fmt: str = "", secrets: Iterable[str] = ()) -> None:
    """Logging as `--log.level` and `--log.format` say, else as the config's `log` (`level`, `fmt`) does."""
    setup_logging(args.log_level or level, args.log_format or fmt, secrets)


def _configured(args: argparse.Namespace) -> tuple[Config, Clock]:
    """The command's config (exits on a bad one), logging as it and the flags say, and its billing clock."""
    config = load_config(args.config)
    _logging(args, config.log.level, config.log.format, config.secret_values())
    return config, Clock(config.billing.zone)


def cmd_once(args: argparse.Namespace) -> int:
    config, clock = _configured(args)
    latest = Latest()
    sources = Sources(config, latest, clock, StateStore(":memory:"), external_url="")
    try:
        try:
            sources.refresh_once()
        except RefreshFailed as error:
            print(f"inference-cost-exporter: {error}", file=sys.stderr)
            return EXIT_SOURCE
        for name, account in sources.accounts.items():  # a wrong key or URL is a config problem, not an outage
            problem = unusable(account.probes.values())
            if problem is not None:
                print(f"inference-cost-exporter: {f'account {name}: ' if name else ''}{problem}", file=sys.stderr)
                return EXIT_SOURCE
        sys.stdout.write(sources.exposition.render()[0].decode())
    finally:
        sources.close()
    return 0


def cmd_digest(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    if args.send and config.digest is None:
        print(f"{args.config}: digest: not configured; `--send` sends through `digest.notifiers`", file=sys.stderr)
        return EXIT_CONFIG
    _logging(args, config.log.level, config.log.format, config.secret_values())
    schedule = config.digest.schedule if config.digest is not None else "daily"
    clock = Clock(config.billing.zone)
    latest = Latest()
    store = StateStore(":memory:")
    chosen_ones = chosen_accounts(config, args, "digest", every=True)  # (a name that is none: before any request)
    sources = Sources(config, latest, clock, store, external_url=config.server.external_url or "")
    try:
        try:  # (the probes' runs are the daemon's, below)
            others = sources.refresh_once(("bills", "history", "usage"), needed={name for name, _ in chosen_ones})
        except RefreshFailed as error:
            print(f"inference-cost-exporter: {error}", file=sys.stderr)
            return EXIT_SOURCE
        for failed in others:  # (an account not asked for: only the budgets shared with it miss its figures)
            print(f"inference-cost-exporter digest: note: {failed}", file=sys.stderr)
        today = clock.today()
        # The probe runs and firing alerts are the running daemon's, read from its state file.
        held = peek(config.state.path, *sources.digest_span(today, schedule))
        own, alerts = [], []
        if held is None:
            state = config.state.path
            what = (
                "is not there" if not Path(state).exists()
                else "is not a file" if not Path(state).is_file()
                else "cannot be read (the warning above says why)"
            )  # fmt: skip
            print(f"note: the state file {state} {what}: no probe runs or alerts to report", file=sys.stderr)
        else:
            readable, unreadable = saved_alerts(held[1])
            own, alerts = held[0], list(readable.values())
            if unreadable:
                print(f"note: {len(unreadable)} saved alerts cannot be read, left out: {', '.join(unreadable[:5])}",
                      file=sys.stderr)  # fmt: skip
        bodies, firing = [], FiringByAccount(lambda: alerts, config.several)
        files = files_for(account_ids(config), peek_account_files(config.state.path))
        for name, _ in chosen_ones:
            runs = own  # (the account whose file is the process's own)
            if files[name].file:  # (one of another file)
                of_account = peek(account_state_path(config.state.path, files[name].file),
                                  *sources.digest_span(today, schedule))  # fmt: skip
                runs = [] if of_account is None else of_account[0]
            url = config.server.external_url or ""
            bodies.append(sources.digest(today, schedule, url, runs=runs, alerts=firing.of(name), account=name))
        sys.stdout.write("\n".join(digest_text(body) for body in bodies))
        if not args.send:
            return 0
        assert config.digest is not None
        # A dispatcher of its own, with the digest's notifiers only and nothing else queued.
        chosen = [n for n in config.alerts.notifiers if n.name in config.digest.notifiers]
        sender = Dispatcher(chosen, AlertStore(store), clock, lambda _: [], config.server.external_url or "")
        sender.retrying = False  # (tried once: what is not sent is said, and the exit status tells)
        for n, body in enumerate(bodies):
            sender.store.enqueue_digest(f"now:{time.time()}:{n}", config.digest.notifiers, body, time.time())
        sender.deliver()
        left = sender.pending()
        for name in config.digest.notifiers:
            print(f"{name}: {'not sent' if left.get(name) else 'sent'}", file=sys.stderr)
        return EXIT_SOURCE if any(left.values()) else 0
    finally:
        sources.close()


def cmd_backtest(args: argparse.Namespace) -> int:
    from exporter.replay.backtest import backtest, render

    config, clock = _configured(args)
    last = args.to or clock.period()
    if args.start > clock.period():  # (first: without --to, the month it would name is this one)
        print(f"inference-cost-exporter: backtest: --from {args.start} has not begun yet", file=sys.stderr)
        return EXIT_USAGE
    if args.start > last:
        print(f"inference-cost-exporter: backtest: --from {args.start} is after --to {last}", file=sys.stderr)
        return EXIT_USAGE
    if last > clock.period():  # (as backfill and export focus refuse it: it would stop at today, unsaid)
        print(f"inference-cost-exporter: backtest: --to {last} has not begun yet", file=sys.stderr)
        return EXIT_USAGE
    try:
        check_range(args.start, last)
    except ValueError as error:
        print(f"inference-cost-exporter: backtest: {error}", file=sys.stderr)
        return EXIT_USAGE
    ((name, account),) = chosen_accounts(config, args, "backtest")
    try:
        if args.forecast:  # how right the month-end forecast was, day by day
            from exporter.replay.forecast_backtest import forecast_backtest
            from exporter.replay.forecast_backtest import render as render_forecast

            rows, notes = forecast_backtest(account, args.start, last, clock)
            output = render_forecast(rows, args.format)
        else:
            fired, notes = backtest(account, args.start, last, clock, account=name)
            output = render(fired, args.format)
    except BillingError as error:
        print(f"inference-cost-exporter: backtest: {error}", file=sys.stderr)
        return EXIT_SOURCE
    for note in notes:
        print(f"{args.config}: {note}", file=sys.stderr)
    sys.stdout.write(output)
    return 0


def _output(command: str, written: str) -> Path | None:
    """The --output file, or None (said in one line) when it names a directory (`dir/`, `dir/.`):
    `Path` would drop the trailing separator or dot and write a file of the directory's name."""
    if os.path.basename(written) in ("", ".", ".."):
        print(f"inference-cost-exporter {command}: error: --output {written} names a directory; give a file's name",
              file=sys.stderr)  # fmt: skip
        return None
    return Path(written)


def _cannot_write(command: str, output: Path, error: OSError) -> int:
    """A file command's output that could not be written: one line, and the exit status."""
    print(f"inference-cost-exporter {command}: cannot write {output}: {error.strerror or error}", file=sys.stderr)
    return EXIT_USAGE


def _say_skipped(command: str, skipped: Iterable[tuple[str, str]]) -> None:
    """The months a file command left out, and why: a line each."""
    for period, why in skipped:
        print(f"inference-cost-exporter {command}: {period} skipped: {why}", file=sys.stderr)


def cmd_backfill(args: argparse.Namespace) -> int:
    config, clock = _configured(args)
    try:
        periods = months(args.first, args.last, clock.period())
        target = target_labels(args.label)
    except ValueError as error:
        print(f"inference-cost-exporter backfill: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    ((name, account),) = chosen_accounts(config, args, "backfill")
    if name and "account" in dict(target):
        print(
            "inference-cost-exporter backfill: error: argument --label: account is the exporter's own label"
            f" with `accounts` (here {name}, from --account)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    directory = args.output_dir is not None
    if args.output_dir == "":
        print("inference-cost-exporter backfill: error: --output-dir names no directory", file=sys.stderr)
        return EXIT_USAGE
    output = Path(args.output_dir) if directory else _output("backfill", args.output)
    if output is None:
        return EXIT_USAGE
    with BillingClient.from_config(account.billing, clock) as client:
        try:
            result = backfill(
                client,
                clock,
                periods,
                output,
                grace_days=account.billing.previous_month_grace_days,
                history=account.billing.history_months > 0,
                target=target,
                account=name,  # as the live series of the account are labelled
                history_months=account.billing.history_months,
                level=account.forecast.interval,
                directory=directory,
            )
        except BackfillError as error:
            print(f"inference-cost-exporter backfill: {error}", file=sys.stderr)
            return EXIT_SOURCE
        except OSError as error:
            return _cannot_write("backfill", output, error)
    _say_skipped("backfill", result.skipped)
    if not {"job", "instance"} <= {name for name, _ in target}:
        print("inference-cost-exporter backfill: note: Prometheus adds `job` and `instance` to the live series; "
              "without --label job=... --label instance=... as your scrape config sets them, the backfilled "
              "series stay apart from the live ones", file=sys.stderr)  # fmt: skip
    size = sum(path.stat().st_size for path in result.files) / 1e6
    count = len(result.files)
    files = f" ({count} file{'s' if count > 1 else ''})" if directory else ""
    print(
        f"wrote {output}{files}: {', '.join(result.written)}: "
        f"{result.series:,} series, {result.samples:,} samples from {result.start:%Y-%m-%d %H:%M} to "
        f"{result.end:%Y-%m-%d %H:%M} ({config.billing.timezone}), {size:,.1f} MB"
    )
    load = "promtool tsdb create-blocks-from openmetrics --max-block-duration=486h"
    if directory:
        print(f'load them with: for file in {shlex.quote(str(output))}/*.om; do {load} "$file" DIR; done')
    else:
        print(f"load it with: {load} {shlex.quote(str(output))} DIR")
    print(
        "query its bill series through last_over_time(...[1h]), as the dashboard does: their samples are an hour apart"
    )
    return 0


def cmd_export_focus(args: argparse.Namespace) -> int:
    config, clock = _configured(args)
    try:
        periods = months(args.first, args.last, clock.period())
    except ValueError as error:
        print(f"inference-cost-exporter export focus: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    ((name, account),) = chosen_accounts(config, args, "export focus")
    output = _output("export focus", args.output)
    if output is None:
        return EXIT_USAGE
    currency = account.billing.currency
    with BillingClient.from_config(account.billing, clock) as client:
        try:
            result = export(client, clock, periods, output, account=name or account.billing.access_key_id,
                            account_name=name or None, currency=currency)  # fmt: skip
        except MissingCurrency as error:  # (it names the account)
            print(f"inference-cost-exporter export focus: {error}", file=sys.stderr)
            return EXIT_CONFIG
        except FocusError as error:
            print(f"inference-cost-exporter export focus: {error}", file=sys.stderr)
            return EXIT_SOURCE
        except OSError as error:
            return _cannot_write("export focus", output, error)
    _say_skipped("export focus", result.skipped)
    print(
        f"wrote {output}: {', '.join(result.written)}: {result.rows:,} rows (FOCUS 1.0), "
        f"{result.billed:f} {currency} billed"
    )
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
    leave_by = time.monotonic() + SHUTDOWN_GRACE
    if not daemon.stop() or not _threads_end(leave_by):
        os._exit(0)  # a refresh is stuck in a network call; the state store is transactional, so leave now
    return 0


def _threads_end(by: float) -> bool:
    """Whether every thread the interpreter's exit would wait for (a billing client's page workers,
    whose requests `stop` has cut) has ended by `by` (monotonic): one stuck where no deadline reaches
    (a host name being resolved) would hold the exit past the 10 s a stop promises."""
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join(max(0.0, by - time.monotonic()))
            if thread.is_alive():
                return False
    return True


def _state_problem(error: StateError) -> SystemExit:
    """The state file cannot be used (corrupt, read-only, in use by another exporter): one line, exit 1."""
    print(f"inference-cost-exporter: {error}", file=sys.stderr)
    return SystemExit(EXIT_CONFIG)


def _listen(address: str) -> str:
    """`--listen` or `server.listen`, checked: one line and exit 1 if it is not HOST:PORT."""
    try:
        parse_listen(address)
    except ValueError:
        print(f"inference-cost-exporter: listen address {address!r} is not HOST:PORT (for example :9877, "
              "127.0.0.1:9877 or [::1]:9877; the port 0 to 65535)", file=sys.stderr)  # fmt: skip
        raise SystemExit(EXIT_CONFIG) from None
    return address


def _start(daemon_factory: Callable[[], Daemon], listen: str) -> Daemon:
    try:
        daemon = daemon_factory()
    except StateError as error:
        raise _state_problem(error) from None
    except WebConfigError as error:  # each problem with the file and its field
        print("\n".join(error.details), file=sys.stderr)
        raise SystemExit(EXIT_CONFIG) from None
    except OSError as error:
        print(f"inference-cost-exporter: cannot listen on {listen}: {error.strerror or error}", file=sys.stderr)
        raise SystemExit(EXIT_CONFIG) from None
    daemon.start()
    return daemon


def _reset_state(config: Config) -> None:
    """`--reset-state`: move a corrupt state file aside now (the daemon then opens the fresh one),
    the process's own and each account's of its config (`accounts`), which the daemon opens too."""
    path = config.state.path
    try:
        StateStore(path, reset=True).close()
        for account in files_for(account_ids(config), peek_account_files(path)).values():
            if account.file:  # ("": the process's own, above)
                StateStore(account_state_path(path, account.file), reset=True).close()
    except StateError as error:
        raise _state_problem(error) from None


def cmd_run(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    _logging(args, config.log.level, config.log.format, config.secret_values())
    listen = _listen(args.listen or config.server.listen)
    if args.reset_state:
        _reset_state(config)
    _hold_signals()
    daemon = _start(lambda: Daemon(config, config_path=args.config, listen=listen, web_config=args.web_config), listen)
    return _serve_until_signalled(daemon)


def cmd_demo(args: argparse.Namespace) -> int:
    _logging(args)
    listen = _listen(args.listen)
    _hold_signals()
    sim, sim_server, workdir, config = demo_scenario()
    stop = threading.Event()
    try:
        daemon = _start(lambda: Daemon(config, listen=listen, web_config=args.web_config), listen)
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
    from exporter.app.demo import simulated
    from exporter.sim import Simulator

    host, port = parse_listen(_listen(args.listen))
    _hold_signals()
    sim = Simulator(latency=args.latency, time_to_first_token=args.ttft, chunk_delay=args.chunk_delay)
    simulated(sim, args.records)
    try:
        server = sim.serve(host or "127.0.0.1", port)
    except OSError as error:
        print(f"inference-cost-exporter: cannot listen on {args.listen}: {error.strerror or error}", file=sys.stderr)
        return EXIT_CONFIG
    print(f"simulator at {server.url}", flush=True)
    print(f"  billing:   access_key_id {sim.access_key_id}  secret_access_key {sim.secret_access_key}")
    print(f"  inference: api_key {sim.api_key}  endpoints {', '.join(e.endpoint_id for e in sim.endpoints)}")
    print('  control:   POST /_sim/usage {"count": N}, /_sim/fault {"kind": ...}, /_sim/clear', flush=True)
    signal.sigwait(SIGNALS)
    server.stop()
    return 0
