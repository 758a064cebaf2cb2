"""The `inference-cost-exporter` command: its arguments here, each command's work in `commands`
(imported when a command runs, not to parse its arguments)."""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from exporter import __version__
from exporter.core.lognames import FORMATS, LEVELS
from exporter.replay import MAX_MONTHS

CONFIG_ENV = "INFERENCE_COST_EXPORTER_CONFIG"


def _period(value: str) -> str:
    """`--from` / `--to`: a billing month, YYYY-MM."""
    from exporter.core.clock import month_problem  # (here: `--version` and `--help` start without it)

    if problem := month_problem(value):
        raise argparse.ArgumentTypeError(problem)
    return value


def _none_or_more(cast: Callable[[str], float], what: str) -> Callable[[str], float]:
    """An option's type: `what` (a whole number, seconds), 0 or more and finite."""

    def parsed(value: str) -> float:
        try:
            number = cast(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {what}: {value!r}") from None
        if not 0 <= number < float("inf"):
            raise argparse.ArgumentTypeError(f"must be {what}, 0 or more")
        return number

    return parsed


SECONDS = _none_or_more(float, "a number of seconds")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Says an option's default where it has one: not on a required option, a switch, or an option that is unset
    unless given (None, or an empty list), where argparse's own would say `(default: None)`."""

    def __init__(self, prog: str, indent_increment: int = 2, max_help_position: int = 24, width: int | None = None):
        # The terminal's width as argparse's own reads it (`COLUMNS`, else the terminal's, else 80), without
        # importing shutil for it: argparse makes a formatter for every option it adds (`bench.startup`).
        if width is None:
            try:
                columns = int(os.environ.get("COLUMNS", ""))
            except ValueError:
                columns = 0
            if columns <= 0:
                try:
                    columns = os.get_terminal_size(sys.__stdout__.fileno()).columns  # type: ignore[union-attr]
                except (AttributeError, ValueError, OSError):
                    columns = 0
            width = (columns or 80) - 2
        super().__init__(prog, indent_increment, max_help_position, width)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        default = action.default
        if action.required or action.nargs == 0 or default is None or default == []:
            return action.help
        return super()._get_help_string(action)


def _command(
    commands: argparse._SubParsersAction[argparse.ArgumentParser], name: str, summary: str, description: str
) -> argparse.ArgumentParser:
    command = commands.add_parser(name, help=summary, description=description, formatter_class=_HelpFormatter)
    command.set_defaults(command_parser=command)  # (an argument it does not know: its own usage says so)
    return command


def _config_option(command: argparse.ArgumentParser) -> None:
    default = os.environ.get(CONFIG_ENV) or None  # (set empty: not set)
    command.add_argument(
        "--config",
        metavar="FILE",
        required=default is None,
        default=default,
        help=f"the YAML config file (or set {CONFIG_ENV})",
    )


def _account_option(command: argparse.ArgumentParser, what: str) -> None:
    command.add_argument("--account", metavar="NAME", help=what)


def _log_options(command: argparse.ArgumentParser, *, config: bool = True) -> None:
    """`--log.level` and `--log.format`, as the Prometheus exporters spell them (the config's spellings too); with a
    `config`, they override its `log` section."""
    level, fmt = (None, None) if config else ("info", "logfmt")
    overrides = " (overrides log.level)" if config else ""
    command.add_argument(
        "--log.level", dest="log_level", choices=LEVELS, default=level, metavar="LEVEL",
        help=f"debug, info, warn or error{overrides}",
    )  # fmt: skip
    command.add_argument(
        "--log.format", dest="log_format", choices=FORMATS, default=fmt, metavar="FORMAT",
        help=f"logfmt or json{overrides.replace('level', 'format')}",
    )  # fmt: skip


def _web_options(command: argparse.ArgumentParser, listen: str, default: str | None = None) -> None:
    """`--web.listen-address` (`--listen` too) and `--web.config.file`, as the Prometheus exporters spell them; with
    no `default` address, the command reads a config (whose server.listen it overrides, and which SIGHUP reloads)."""
    command.add_argument(
        "--web.listen-address", "--listen", dest="listen", default=default, metavar="ADDR", help=listen
    )
    with_config = " (instead of server.tls and server.basic_auth; read again on SIGHUP)" if default is None else ""
    command.add_argument(
        "--web.config.file", dest="web_config", metavar="FILE",
        help="a web configuration file in exporter-toolkit's format: TLS, client certificates, basic auth users "
        f"with bcrypt hashes, response headers{with_config}",
    )  # fmt: skip


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The program's parser; with `only`, one whose sole command is that one (what parsing its command
    line needs, for a quicker start: `bench.startup`)."""
    parser = argparse.ArgumentParser(
        prog="inference-cost-exporter",
        description="Prometheus exporter for an LLM inference account's bills, token usage and endpoints.",
        formatter_class=_HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, add in _BUILDERS.items():
        if only in (None, name):
            add(commands)
    return parser


def _check_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    check = _command(
        commands, "check", "validate a config: every problem with its location (exit 1), or a summary (exit 0)",
        "Validate a config file without contacting any API. Prints every problem, one per line, with its "
        "location (e.g. `alerts.rules[2].threshold: not a number`) and exits 1; or prints a one-line summary "
        "(probes, budgets, rules, notifiers) and exits 0. Warns about secrets written in the file itself.",
    )  # fmt: skip
    _config_option(check)
    check.set_defaults(func="config_commands:cmd_check")


def _once_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    once = _command(
        commands, "once", "refresh every source once and print the exposition on stdout",
        "Refresh every source once (bills, usage, each probe) and print the metrics exposition on stdout. "
        "Exits 1 for a bad config, 2 when an API refuses or cannot be reached (or refuses the inference key), "
        "with a one-line reason on stderr.",
    )  # fmt: skip
    _config_option(once)
    _log_options(once)
    once.set_defaults(func="commands:cmd_once")


def _run_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    run = _command(
        commands, "run", "the daemon: scheduled refreshes, /metrics, alerts",
        "Run the exporter: refresh every source on its interval, serve /metrics, the landing page and health, "
        "evaluate alert rules and deliver notifications. SIGHUP reloads the config; SIGTERM or SIGINT stop it.",
    )  # fmt: skip
    _config_option(run)
    _web_options(run, "where the HTTP server listens, e.g. :9877 or 127.0.0.1:9877 (overrides server.listen)")
    _log_options(run)
    run.add_argument(
        "--reset-state",
        action="store_true",
        help="if the state file is corrupt, keep it as <path>.corrupt-TIMESTAMP and start with a fresh one",
    )
    run.set_defaults(func="commands:cmd_run")


def _digest_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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
    _account_option(digest, "the account whose digest to make (with `accounts`: every account's when not given)")
    _log_options(digest)
    digest.set_defaults(func="commands:cmd_digest")


def _rules_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    rules = _command(
        commands, "rules", "the YAML alert rules as a Prometheus alerting-rule file",
        "Print the config's alert rules as a Prometheus alerting-rule file over this exporter's metrics, for "
        "teams that evaluate alerts in Prometheus. Rules only the exporter can compute are skipped with a note.",
    )  # fmt: skip
    _config_option(rules)
    rules.set_defaults(func="config_commands:cmd_rules")


def _backtest_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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
    replay.add_argument(
        "--forecast",
        action="store_true",
        help="instead, the month-end forecast as it stood on each day of the months that ended, against their "
        "actual totals: its error by day of month beside today's formula and a naive one, and how often the "
        "actual fell inside its interval",
    )
    replay.add_argument("--format", choices=("text", "json"), default="text", help="text, or JSON lines")
    _account_option(replay, "the account to replay (required with `accounts`)")
    _log_options(replay)
    replay.set_defaults(func="commands:cmd_backtest")


def _backfill_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    backfill_command = _command(
        commands, "backfill", "past months' bill series as OpenMetrics, for promtool to load into Prometheus",
        "Fetch the daily bills of the months --from ... --to and write the series the exporter exposes from them, "
        "with timestamps (a bill series' an hour apart: read them through last_over_time(...[1h]), as the dashboard "
        "does), as OpenMetrics text for `promtool tsdb create-blocks-from openmetrics FILE DIR`. Only complete days "
        "(of this month: before today). "
        "A month the API refuses or lists nothing for is skipped and said. Exits 2 for a bad --from, --to, --label "
        "or --output (--output-dir), and when nothing could be written.",
    )  # fmt: skip
    _config_option(backfill_command)
    backfill_command.add_argument("--from", dest="first", required=True, metavar="YYYY-MM", help="the first month")
    backfill_command.add_argument(
        "--to", dest="last", metavar="YYYY-MM", help="the last month (when not given: this month, its complete days)"
    )
    written = backfill_command.add_mutually_exclusive_group(required=True)
    written.add_argument("--output", metavar="FILE", help="the file to write (replaced when complete)")
    written.add_argument(
        "--output-dir",
        metavar="DIR",
        help="a directory (made if it is not there) for a file per block promtool makes (486 h): for more than a "
        "few months, which promtool then loads in a time that grows as they do, into blocks that never overlap",
    )
    backfill_command.add_argument(
        "--label",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a label your Prometheus adds to the exporter's series (job, instance); repeat for each",
    )
    _account_option(backfill_command, "the account to backfill (required with `accounts`; its series get `account`)")
    _log_options(backfill_command)
    backfill_command.set_defaults(func="commands:cmd_backfill")


def _export_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    export = _command(
        commands, "export", "the bills in another format", "Write past months' billed charges in another format.",
    )  # fmt: skip
    formats = export.add_subparsers(dest="format", required=True, metavar="FORMAT")
    focus = formats.add_parser(
        "focus", help="FOCUS 1.0 rows (CSV)", formatter_class=_HelpFormatter,
        description="Fetch the daily bills of the months --from ... --to and write them as FOCUS 1.0 rows (the FinOps "
        "Foundation's cost and usage format), one per day, endpoint and billing item, as CSV. Needs "
        "billing.currency. Only complete days (of this month: before today). A month the API refuses or lists "
        "nothing for is skipped and said. Exits 1 for a bad config or no currency, 2 for a bad --from, --to or "
        "--output, a refused key, or nothing to write.",
    )  # fmt: skip
    _config_option(focus)
    focus.add_argument("--from", dest="first", required=True, metavar="YYYY-MM", help="the first month")
    focus.add_argument("--to", dest="last", metavar="YYYY-MM", help="the last month (when not given: this month)")
    focus.add_argument("--output", required=True, metavar="FILE", help="the CSV file to write (replaced when complete)")
    _account_option(focus, "the account to export (required with `accounts`)")
    _log_options(focus)
    focus.set_defaults(func="commands:cmd_export_focus", command_parser=focus)


def _demo_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    demo = _command(
        commands, "demo", "the embedded simulator and the daemon, no credentials needed",
        "Start the stand-in billing and chat service on loopback and the exporter against it, with growing "
        "usage and an occasional failing chat request, and print the URLs.",
    )  # fmt: skip
    _web_options(demo, "where the exporter listens", default="127.0.0.1:9877")
    _log_options(demo, config=False)
    demo.set_defaults(func="commands:cmd_demo")


def _simulate_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    simulate = _command(
        commands, "simulate", "run the stand-in service alone",
        "Run the stand-in billing and chat service alone, to point an exporter or a dashboard at it. Its "
        "credentials are printed; POST /_sim/usage, /_sim/fault and /_sim/clear control it.",
    )  # fmt: skip
    simulate.add_argument("--listen", default="127.0.0.1:9878", metavar="ADDR", help="where it listens")
    simulate.add_argument(
        "--records",
        type=_none_or_more(int, "a whole number"),
        default=2000,
        help="usage records for today (a quarter as many on each of the 35 days before)",
    )
    simulate.add_argument("--latency", type=SECONDS, default=0.0, help="seconds added to every request")
    simulate.add_argument("--ttft", type=SECONDS, default=0.05, help="chat time to first token, seconds")
    simulate.add_argument("--chunk-delay", type=SECONDS, default=0.01, help="seconds between streamed chunks")
    simulate.set_defaults(func="commands:cmd_simulate")


_BUILDERS = {
    "check": _check_command,
    "once": _once_command,
    "run": _run_command,
    "digest": _digest_command,
    "rules": _rules_command,
    "backtest": _backtest_command,
    "backfill": _backfill_command,
    "export": _export_command,
    "demo": _demo_command,
    "simulate": _simulate_command,
}


_SERVING = frozenset({"run", "demo", "simulate"})
"""The commands that serve until stopped, and take their signals themselves."""
_READING_ONLY = frozenset({"check", "rules"})
"""The commands that read their config and print what they found, and nothing else (no thread, no file
left open, nothing registered to run at exit): the program ends once their output is out (`_exit_now`)."""


class Terminated(BaseException):
    """SIGTERM, in a command that runs to its end: like KeyboardInterrupt, no `Exception` (a handler
    of those must not take it, and work in flight is not waited for)."""


def _terminate(signum: int, frame: object) -> None:
    _stopping()
    raise Terminated


def _interrupt(signum: int, frame: object) -> None:
    _stopping()
    raise KeyboardInterrupt


def _stopping() -> None:
    """A stop was asked for: the signals after it are ignored until the process ends (a second
    Ctrl-C, a supervisor's SIGTERM sent again), so that what the stop does on its way out (a partial
    file removed, the requests in flight cut) is not cut short, and it is said once, with its exit
    status, without a traceback."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


_OUTPUT_FAULTS = frozenset({errno.ENOSPC, errno.EIO, errno.EBADF, errno.EFBIG, errno.EDQUOT})
"""What a write to the standard output meets when it cannot be written (the errors of a file
opened by name carry its name, and are the commands' own to tell)."""


def main(argv: Sequence[str] | None = None, *, program: bool = False) -> int:
    """Run the command `argv` names (sys.argv's by default), its exit status. `program`: run as
    the program (`entry`), which exits after it: once a signal stopped the command, the signals
    after it stay ignored (a process that runs `main` among other work gets its handlers back)."""
    given = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(given[0] if given and given[0] in _BUILDERS else None)
    args, unknown = parser.parse_known_args(given)
    if unknown:  # with the usage of the command it came after, not the program's
        getattr(args, "command_parser", parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    # The commands, and all they import, load only once one runs: `--version` and `--help` start at once.
    module, name = args.func.split(":")
    command = getattr(importlib.import_module(f"exporter.cli.{module}"), name)
    if sys.stdout is None:  # (started without one, `>&-`: what a command writes goes nowhere)
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - the process's, for its life
    if args.command in _SERVING:  # (they take their signals themselves)
        return _run_to_its_end(command, args)
    # The handlers of before are put back once it has run, however it ended (a process that runs
    # `main` among other work; `entry`, the program's, ignores the signals after a stop till it exits).
    before = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    signal.signal(signal.SIGTERM, _terminate)
    if before[signal.SIGINT] is signal.default_int_handler:  # (not where Ctrl-C was set aside)
        signal.signal(signal.SIGINT, _interrupt)
    try:
        status = _run_to_its_end(command, args)
    finally:
        if not (program and signal.getsignal(signal.SIGTERM) is signal.SIG_IGN):  # (stopped: `_stopping`)
            for signum, handler in before.items():
                signal.signal(signum, handler)
    if program and args.command in _READING_ONLY:
        _exit_now(status)
    return status


def entry() -> NoReturn:
    """The program (its console script, `python -m exporter.cli`): `main`, then its exit. Once a
    signal stopped a command, the signals after it stay ignored while the interpreter ends (its
    threads joined), so that the stop is said once, with its own status."""
    sys.exit(main(program=True))


def _run_to_its_end(command: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """The command's status, or one line for what stopped it: a reader gone, an output that cannot
    be written, Ctrl-C or SIGTERM (of a command that runs to its end)."""
    said = f"inference-cost-exporter: {f'export {args.format}' if args.command == 'export' else args.command}:"
    try:
        status = int(command(args))
        sys.stdout.flush()  # (here, not at the exit: a write that fails is told as one)
        return status
    except BrokenPipeError:  # the reader went away (`check | head -1`): what is left goes nowhere, quietly
        _output_nowhere()
        return 128 + signal.SIGPIPE  # (as SIGPIPE ends other tools: not the 1 of `check`'s bad config)
    except OSError as error:  # the output itself (a full disk): one line, not a traceback
        if error.filename is not None or error.errno not in _OUTPUT_FAULTS:
            raise
        print(f"{said} cannot write its output: {error.strerror}", file=sys.stderr)
        _output_nowhere()
        return 2
    except KeyboardInterrupt:  # Ctrl-C: one line, as for any other stop (an output file is left as it was)
        print(f"{said} interrupted", file=sys.stderr)
        return 130
    except Terminated:  # the same for SIGTERM (a timeout, `kill`): a partial output file is removed too
        print(f"{said} terminated", file=sys.stderr)
        return 128 + signal.SIGTERM


def _exit_now(status: int) -> NoReturn:
    """End the process with `status` once the standard streams are flushed, without the interpreter's
    teardown of every module and object: a tenth of `check`'s and `rules`' run (`bench.startup`)."""
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:  # (None: started without it, `2>&-`)
            with contextlib.suppress(OSError, ValueError):  # (a reader gone: what is left goes nowhere)
                stream.flush()
    os._exit(status)


def _output_nowhere() -> None:
    """Standard output to /dev/null: the exit's flush of what is left goes nowhere."""
    with contextlib.suppress(OSError):
        nowhere = os.open(os.devnull, os.O_WRONLY)
        os.dup2(nowhere, sys.stdout.fileno())
        os.close(nowhere)
