"""Several accounts: N accounts in one exporter process ÷ N exporter processes of one account each,
side by side against the same N simulators: CPU per hour, memory, and how soon a refresh's figures
reach /metrics.

    python -m bench.accounts [--accounts 50] [--seconds 120] [--speedup 30] [--scrape-every 0.2]
                             [--idle-seconds 60] [--records 2000]

The simulators (each its own port, keys, four endpoints and `--records` usage records today, growing
by 1-10 records every 2 s in the sped-up windows only) run in one helper process. The setups run one
after the other, the one process first (the one-account exporters launched LAUNCH_STAGGER apart),
each launched twice with fresh state files: at the default intervals, to measure what it takes
between refreshes, then at the default intervals ÷ `--speedup` (bills 15 min, usage 5 min; history
kept at its default 3 months: fetched at start-up, then checked every 600 s whatever the speed-up, so
within the window it runs only at start-up). Every exporter's /metrics is scraped as Prometheus asks
for it (OpenMetrics, gzip) every `--scrape-every` seconds, the exporters' scrapes spread over that
period.

Each launch waits for every account's first refresh of bills, usage and history, and for what those
set off to end (SETTLED_CORES): the warm-up, left out. Measured then:
- CPU: utime+stime of the exporter processes (/proc/PID/stat; the simulators' not counted), split
  into what the threads that ended took (the HTTP server's: a thread per request, so our scrapes)
  and the rest (refreshes, alerts, the scheduler, the accept loop: the threads still alive,
  /proc/PID/task/*/stat). Sped up, over `--seconds`; at the default intervals, over `--idle-seconds`
  after the first refreshes, half of it scraped (idle A), half not (idle B): for the N processes no
  refresh is due then; the one process spreads its accounts over each interval (the n-th of N runs
  (N − n) ÷ N of an interval after the start), so a few of its refreshes fall in these windows and
  count against it (about one in five accounts' usage, one in fifteen's bills). Per hour at the default
  intervals: the rest ÷ speed-up, which holds as far as the refresh work dominates the rest; and
  idle B + (the rest − idle A) ÷ speed-up, which scales only the refreshes: N processes idle at a
  cost the one process pays once. When an exporter falls behind (its data got older than 1.5 × the
  interval and its jitter), its CPU is capped (one GIL a process) and both understate the refreshes
  due; the per-refresh figure (÷ refreshes done × refreshes due) does less so.
- Each refresh's duration as the exporter reports it, and the simulators' process's CPU (were they
  the bottleneck?).
- Memory at the end of the window: VmRSS (/proc/PID/status) and PSS (/proc/PID/smaps_rollup, which
  splits the library pages the processes share), summed over the processes.
- Freshness: whenever an account's `inference_exporter_last_refresh_success_timestamp_seconds` for a
  source changes, the time it was first seen on /metrics (the scrape's answer in hand) − its value:
  median, p95 and max (the scrape period adds up to itself); and the oldest data (the scrape's time
  − the last success) any account's bills and usage reached at any scrape.
- What the exporters logged at warning or error, counted by message.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import gzip
import http.client
import json
import math
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from types import FrameType
from urllib.parse import urlsplit

from exporter.config.load import validate

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("bills", "usage", "history")
AGED = ("bills", "usage")
"""Sources whose data age is followed (history is checked every 600 s whatever the speed-up)."""
ENDPOINTS = 4
GROWTH_EVERY = 2.0
"""Seconds between the simulators' new usage records (1-10 per account)."""
HEALTH = b"inference_exporter_last_refresh_success_timestamp_seconds"
DURATION = b"inference_exporter_refresh_duration_seconds"
SERIES = re.compile(rb"^[a-z_]+\{([^}]*)\} (\S+)$", re.MULTILINE)
LABEL = re.compile(rb'(\w+)="([^"]*)"')
COMPLAINT = re.compile(
    rb'ts=(\S+) level=(warning|error) component=\S+ msg=("[^"]*"|\S+)(?:[^\n]*? (?:error|reason)=("[^"]*"|\S+))?'
)
"""A log line at warning or error: its time, level, message, and error or reason if it gives one."""
LOOPBACK = re.compile(r"http://127\.0\.0\.1:\d+")
LISTENING = re.compile(rb"msg=listening url=(http://\S+)")
JITTER = 0.1
"""The scheduler adds up to this share of the interval to each run's time (on a fixed grid: the
runs come an interval apart on average)."""
BEHIND = 1.5
"""An exporter is behind when data got older than this × (interval + jitter): its CPU is then capped (cores, GIL)
and its figures per hour understate what the refreshes due would take."""
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
START_TIMEOUT = 300.0
LAUNCH_STAGGER = 0.5
"""Seconds between the launches of the one-account exporters (their first requests in one burst
overwhelm the simulators' one process: time-outs, and at the default intervals a retry 5 min later)."""
SETTLE_SAMPLE = 2.0
SETTLE_LIMIT = 90.0
SETTLED_CORES = 0.5
"""After every account's first refresh, what the last refreshes set off (rendering their figures, evaluating
alerts) goes on for a while: at the default intervals, the idle windows open once the live threads' CPU over
SETTLE_SAMPLE seconds is under this many cores and no longer falling by a fifth (SETTLE_LIMIT at most); the
sped-up window opens as long after the first refreshes."""
STOP_GRACE = 15.0


def _exporter_command() -> list[str]:
    script = Path(sys.executable).with_name("inference-cost-exporter")
    return [str(script)] if script.exists() else [sys.executable, "-m", "exporter.cli"]


# -- the simulators, in a helper process -----------------------------------------------------


def _serve_simulators(count: int, records: int) -> None:
    """Run in the helper process: `count` simulators, one JSON line each on stdout (url, key id,
    secret); their usage grows while stdin last said `grow` (not after `pause`), until it closes
    (the benchmark ended, or died)."""
    from exporter.sim import Endpoint, Simulator  # (the benchmark's own process never imports it)

    sims = []
    for n in range(count):
        endpoints = tuple(Endpoint(f"ep-{n:03d}-{e}", f"model-{e % 2}", f"proj-{e % 2}") for e in range(ENDPOINTS))
        sim = Simulator(
            seed=n + 1,
            access_key_id=f"AK{n:04d}",
            secret_access_key=f"bench-secret-{n:04d}-{random.Random(n).getrandbits(64):016x}",
            endpoints=endpoints,
        )
        sim.add_usage(records)
        server = sim.serve()
        sims.append(sim)
        line = {"url": server.url, "key": sim.access_key_id, "secret": sim.secret_access_key}
        print(json.dumps(line), flush=True)
    stop = threading.Event()
    growing = threading.Event()

    def grow() -> None:
        rng = random.Random(7)
        while not stop.wait(GROWTH_EVERY):
            if growing.is_set():
                for sim in sims:
                    sim.add_usage(rng.randint(1, 10))

    threading.Thread(target=grow, name="growth", daemon=True).start()
    for command in sys.stdin:
        if command.strip() == "grow":
            growing.set()
        elif command.strip() == "pause":
            growing.clear()
    stop.set()


@dataclass(frozen=True)
class SimInfo:
    url: str
    key: str
    secret: str


@dataclass
class Simulators:
    """The helper process's simulators; `grow` starts or pauses their usage growth (paused at first)."""

    infos: list[SimInfo]
    process: subprocess.Popen[str]

    def grow(self, on: bool) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write("grow\n" if on else "pause\n")
        self.process.stdin.flush()


@contextlib.contextmanager
def simulators(count: int, records: int) -> Iterator[Simulators]:
    process = subprocess.Popen(
        [sys.executable, "-m", "bench.accounts", "--serve", str(count), "--records", str(records)],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        found = []
        for _ in range(count):
            line = process.stdout.readline()
            if not line:
                raise RuntimeError(f"the simulators' process ended (exit code {process.wait()})")
            found.append(SimInfo(**json.loads(line)))
        yield Simulators(found, process)
    finally:
        if process.stdin is not None:
            with contextlib.suppress(OSError):
                process.stdin.close()
        _stop([process])


# -- exporter processes ----------------------------------------------------------------------


def _stop(processes: Sequence[subprocess.Popen[bytes] | subprocess.Popen[str]]) -> None:
    """Terminate, then kill what is still running after STOP_GRACE."""
    for process in processes:
        if process.poll() is None:
            with contextlib.suppress(OSError):
                process.terminate()
    deadline = time.monotonic() + STOP_GRACE
    for process in processes:
        try:
            process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(OSError):
                process.kill()
            process.wait()


def _billing(sim: SimInfo, secret_var: str, speedup: float) -> dict[str, object]:
    return {
        "url": sim.url,
        "access_key_id": sim.key,
        "secret_access_key": "${" + secret_var + "}",
        "timeout": "10s",
        "bills_interval": f"{900 / speedup:g}s",
        "usage_interval": f"{300 / speedup:g}s",
    }


@dataclass
class Exporter:
    process: subprocess.Popen[bytes]
    log: Path
    accounts: tuple[str, ...]
    label: str | None
    """The account of a one-account exporter (its series carry no `account` label); None: they do."""
    url: str = ""


def _launch(workdir: Path, name: str, document: dict[str, object], env: dict[str, str]) -> Path:
    validate(document, env)  # a mistake here fails now, not as an exporter that never listens
    path = workdir / f"{name}.yaml"
    path.write_text(json.dumps(document, indent=1))  # JSON is YAML
    path.chmod(0o600)
    return path


def start_one(workdir: Path, names: Sequence[str], sims: Sequence[SimInfo], speedup: float) -> list[Exporter]:
    env = dict(os.environ)
    accounts = []
    for n, (name, sim) in enumerate(zip(names, sims, strict=True)):
        env[f"BENCH_SECRET_{n}"] = sim.secret
        accounts.append({"name": name, "billing": _billing(sim, f"BENCH_SECRET_{n}", speedup)})
    document: dict[str, object] = {"accounts": accounts, "state": {"path": str(workdir / "state.db")}}
    config = _launch(workdir, "one", document, env)
    return [_spawn(config, workdir / "one.log", env, tuple(names), None)]


def start_separate(workdir: Path, names: Sequence[str], sims: Sequence[SimInfo], speedup: float) -> list[Exporter]:
    started: list[Exporter] = []
    try:
        for name, sim in zip(names, sims, strict=True):
            env = dict(os.environ, BENCH_SECRET=sim.secret)
            document = {
                "billing": _billing(sim, "BENCH_SECRET", speedup),
                "state": {"path": str(workdir / f"{name}.db")},
            }
            config = _launch(workdir, name, document, env)
            started.append(_spawn(config, workdir / f"{name}.log", env, (name,), name))
            time.sleep(LAUNCH_STAGGER)
    except BaseException:
        _stop([e.process for e in started])
        raise
    return started


def _spawn(config: Path, log: Path, env: dict[str, str], accounts: tuple[str, ...], label: str | None) -> Exporter:
    with log.open("wb") as out:
        process = subprocess.Popen(
            [*_exporter_command(), "run", "--config", str(config), "--listen", "127.0.0.1:0"],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    return Exporter(process, log, accounts, label)


def wait_listening(exporters: Sequence[Exporter]) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    for exporter in exporters:
        while not exporter.url:
            found = LISTENING.search(exporter.log.read_bytes())
            if found:
                exporter.url = found[1].decode()
            elif exporter.process.poll() is not None:
                tail = exporter.log.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"exporter ended with {exporter.process.returncode} before listening:\n{tail}")
            elif time.monotonic() > deadline:
                raise RuntimeError(f"exporter not listening after {START_TIMEOUT:.0f} s: {exporter.log}")
            else:
                time.sleep(0.1)


# -- /proc -----------------------------------------------------------------------------------


def _cpu_of(stat: str) -> float:
    """utime + stime, in seconds, from a /proc stat line (fields after the command's ')')."""
    fields = stat.rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


@dataclass(frozen=True)
class Cpu:
    total: float
    live: float
    """Of `total`, what the threads still running have taken; the rest went to threads that ended."""

    @property
    def ended(self) -> float:
        return self.total - self.live

    def __sub__(self, other: Cpu) -> Cpu:
        return Cpu(self.total - other.total, self.live - other.live)


def cpu(pids: Sequence[int]) -> Cpu:
    total = live = 0.0
    for pid in pids:
        total += _cpu_of(Path(f"/proc/{pid}/stat").read_text())
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # a thread that just ended
                live += _cpu_of(Path(f"/proc/{pid}/task/{task}/stat").read_text())
    return Cpu(total, live)


def threads(pids: Sequence[int]) -> int:
    return sum(len(os.listdir(f"/proc/{pid}/task")) for pid in pids)


def _kb(path: str, key: str) -> int | None:
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    found = re.search(rf"^{key}:\s+(\d+) kB", text, re.MULTILINE)
    return int(found[1]) if found else None


def memory(pids: Sequence[int]) -> tuple[float, float | None]:
    """VmRSS and PSS (None where smaps_rollup is missing) summed over the processes, in MB."""
    rss = sum(_kb(f"/proc/{pid}/status", "VmRSS") or 0 for pid in pids) / 1024
    pss = [_kb(f"/proc/{pid}/smaps_rollup", "Pss") for pid in pids]
    return rss, (sum(p for p in pss if p is not None) / 1024 if all(p is not None for p in pss) else None)


# -- scraping --------------------------------------------------------------------------------


Seen = dict[tuple[str, str], tuple[float, float | None]]
"""(account, source) → (last success timestamp, last refresh's duration)."""


def _family(body: bytes, name: bytes, label: str | None) -> dict[tuple[str, str], float]:
    """(account, source) → value of the family `name`, from a /metrics body."""
    start = body.find(b"\n" + name + b"{")
    if start < 0:
        return {}
    end = body.find(b"\n#", start + 1)
    found = {}
    for labels, value in SERIES.findall(body, start + 1, len(body) if end < 0 else end):
        named = {k.decode(): v.decode() for k, v in LABEL.findall(labels)}
        account = label if label is not None else named.get("account")
        if account is not None:
            found[(account, named.get("source", ""))] = float(value)
    return found


def health(body: bytes, label: str | None) -> Seen:
    durations = _family(body, DURATION, label)
    return {key: (at, durations.get(key)) for key, at in _family(body, HEALTH, label).items()}


@dataclass
class Watch:
    """What the scrapes saw: every (account, source)'s last timestamp, and within the window the
    freshness of each change, the oldest data, the scrapes' number, failures and response times."""

    accounts: tuple[str, ...]
    seen: dict[tuple[str, str], float] = field(default_factory=dict)
    window: tuple[float, float] | None = None
    freshness: dict[str, list[float]] = field(default_factory=lambda: {s: [] for s in SOURCES})
    durations: dict[str, list[float]] = field(default_factory=lambda: {s: [] for s in SOURCES})
    """Of each refresh seen in the window: how long it took (the exporter's own gauge)."""
    oldest: dict[str, float] = field(default_factory=lambda: dict.fromkeys(AGED, 0.0))
    oldest_per_account: dict[tuple[str, str], float] = field(default_factory=dict)
    scrapes: int = 0
    failures: int = 0
    responses: list[float] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def ready(self) -> bool:
        with self.lock:
            return all((a, s) in self.seen for a in self.accounts for s in SOURCES)

    def missing(self) -> list[str]:
        with self.lock:
            return [f"{a}/{s}" for a in self.accounts for s in SOURCES if (a, s) not in self.seen]

    def _in_window(self, at: float) -> bool:
        return self.window is not None and self.window[0] <= at <= self.window[1]

    def record(self, sent: float, received: float, found: Seen | None) -> None:
        with self.lock:
            inside = self._in_window(received)
            if found is None:
                self.failures += inside
                return
            if inside:
                self.scrapes += 1
                self.responses.append(received - sent)
            for key, (at, duration) in found.items():
                before = self.seen.get(key)
                self.seen[key] = at
                if not inside:
                    continue
                if before is not None and at != before and key[1] in self.freshness:
                    self.freshness[key[1]].append(received - at)
                    if duration is not None:
                        self.durations[key[1]].append(duration)
                if key[1] in self.oldest:
                    age = received - at
                    self.oldest[key[1]] = max(self.oldest[key[1]], age)
                    self.oldest_per_account[key] = max(self.oldest_per_account.get(key, 0.0), age)


PROMETHEUS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0;q=0.5,application/openmetrics-text;version=0.0.1;q=0.4,"
    "text/plain;version=0.0.4;q=0.3,*/*;q=0.1"
)
"""What Prometheus asks for (with gzip): the exporters answer as they answer it."""


def _get(url: str) -> tuple[bytes, float]:
    """/metrics as Prometheus asks for it (on a connection of its own: its server thread ends with it,
    which is how the scrapes' CPU is told apart), and when its last byte arrived (before it is
    decompressed and read, which is the benchmark's work, not the exporter's)."""
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=10)
    try:
        connection.request("GET", "/metrics", headers={"Accept": PROMETHEUS_ACCEPT, "Accept-Encoding": "gzip"})
        response = connection.getresponse()
        body = response.read()
        received = time.time()
        if response.status != 200:
            raise OSError(f"HTTP {response.status}")
        if response.getheader("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        return body, received
    finally:
        connection.close()


class Scraper:
    """A thread per exporter scraping its /metrics every `every` seconds, the exporters' phases
    spread evenly over that period."""

    def __init__(self, exporters: Sequence[Exporter], watch: Watch, every: float) -> None:
        self.stop = threading.Event()
        start = time.monotonic() + 0.05
        self._threads = [
            threading.Thread(target=self._run, args=(e, watch, every, start + every * n / len(exporters)), daemon=True)
            for n, e in enumerate(exporters)
        ]

    def __enter__(self) -> Scraper:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        self.stop.set()
        for thread in self._threads:
            if thread.is_alive():
                thread.join(15)

    def _run(self, exporter: Exporter, watch: Watch, every: float, due: float) -> None:
        while not self.stop.wait(max(0.0, due - time.monotonic())):
            sent = time.time()
            try:
                body, received = _get(exporter.url)
                found: Seen | None = health(body, exporter.label)
            except (OSError, http.client.HTTPException):
                found, received = None, time.time()
            watch.record(sent, received, found)
            now = time.monotonic()
            due += every
            if due < now:  # a slow answer: skip the turns missed, keeping the phase
                due += math.ceil((now - due) / every) * every


# -- one setup -------------------------------------------------------------------------------


@dataclass
class Running:
    """A setup's exporters, listening and each account refreshed once, scraped into `watch`."""

    exporters: list[Exporter]
    watch: Watch
    scraper: Scraper
    warmup: float
    windows: list[tuple[float, float]] = field(default_factory=list)
    """When it was measured (Unix times)."""
    complaints: dict[str, list[int]] = field(default_factory=dict)
    """The exporters' log lines at warning or error, by level and message: how many, how many in
    `windows` (filled when they stop)."""

    @property
    def pids(self) -> list[int]:
        return [e.process.pid for e in self.exporters]


@contextlib.contextmanager
def running(name: str, start: Callable[[Path], list[Exporter]], accounts: tuple[str, ...], every: float) -> Iterator[
    Running
]:  # fmt: skip
    with tempfile.TemporaryDirectory(prefix=f"bench-accounts-{name.replace(' ', '-')}-") as scratch:
        began = time.monotonic()
        exporters = start(Path(scratch))
        try:
            wait_listening(exporters)
            watch = Watch(accounts)
            with Scraper(exporters, watch, every) as scraper:
                while not watch.ready():
                    if time.monotonic() - began > START_TIMEOUT:
                        raise RuntimeError(f"{name}: no first refresh after {START_TIMEOUT:.0f} s: "
                                           f"{', '.join(watch.missing()[:10])}")  # fmt: skip
                    for e in exporters:
                        if e.process.poll() is not None:
                            raise RuntimeError(f"{name}: an exporter ended ({e.process.returncode}); see {e.log}")
                    time.sleep(0.1)
                setup = Running(exporters, watch, scraper, time.monotonic() - began)
                yield setup
        finally:
            _stop([e.process for e in exporters])
        setup.complaints.update(_complaints(exporters, setup.windows))


def _complaints(exporters: Sequence[Exporter], windows: Sequence[tuple[float, float]]) -> dict[str, list[int]]:
    found: dict[str, list[int]] = {}
    for exporter in exporters:
        with contextlib.suppress(OSError):
            for at, level, message, error in COMPLAINT.findall(exporter.log.read_bytes()):
                said = LOOPBACK.sub(
                    "http://SIM", f"{message.decode(errors='replace')} {error.decode(errors='replace')}"
                )
                counts = found.setdefault(f"{level.decode()} {said[:160]}", [0, 0])
                counts[0] += 1
                with contextlib.suppress(ValueError):
                    when = dt.datetime.fromisoformat(at.decode()).timestamp()
                    counts[1] += any(start <= when <= end for start, end in windows)
    return found


def _rest_per_hour(pids: Sequence[int], seconds: float) -> float:
    """CPU-seconds per hour the live threads take over the next `seconds`."""
    before, opened = cpu(pids), time.monotonic()
    time.sleep(seconds)
    return (cpu(pids) - before).live / (time.monotonic() - opened) * 3600


@dataclass
class Idle:
    """CPU-seconds per hour of the live threads at the default intervals, after the first refreshes
    (and before any other is due, but for the one process's spread accounts): scraped as in the busy
    window, then not scraped."""

    warmup: float
    settle: float
    """Seconds from the first refreshes till what they set off was done."""
    scraped: float
    quiet: float
    complaints: dict[str, list[int]]


def _settle(pids: Sequence[int]) -> float:
    began = time.monotonic()
    before = math.inf
    while time.monotonic() - began < SETTLE_LIMIT:
        rate = _rest_per_hour(pids, SETTLE_SAMPLE) / 3600
        if rate < SETTLED_CORES and rate > 0.8 * before:
            break
        before = rate
    return time.monotonic() - began


def measure_idle(name: str, start: Callable[[Path], list[Exporter]], accounts: tuple[str, ...], every: float,
                 seconds: float) -> Idle:  # fmt: skip
    with running(name, start, accounts, every) as setup:
        settle = _settle(setup.pids)
        opened = time.time()
        scraped = _rest_per_hour(setup.pids, seconds / 2)
        setup.scraper.close()
        quiet = _rest_per_hour(setup.pids, seconds / 2)
        setup.windows.append((opened, time.time()))
    return Idle(setup.warmup, settle, scraped, quiet, setup.complaints)


@dataclass
class Result:
    name: str
    processes: int
    warmup: float
    window: float
    cpu: Cpu
    threads: int
    rss_start: float
    rss: float
    pss: float | None
    watch: Watch
    idle: Idle
    complaints: dict[str, list[int]]
    """Of both launches (see Running.complaints)."""
    simulators: float
    """CPU-seconds the simulators' process took in the window."""


def measure_busy(name: str, start: Callable[[Path], list[Exporter]], accounts: tuple[str, ...], every: float,
                 seconds: float, idle: Idle, simulated: Simulators) -> Result:  # fmt: skip
    """The sped-up window, the simulators' usage growing meanwhile (not while the exporters warm up:
    a day's read that takes long then would see `total` move and fail, to be tried only an interval later)."""
    with running(name, start, accounts, every) as setup:
        pids = setup.pids
        time.sleep(idle.settle)
        opened = time.time()
        setup.watch.window = (opened, opened + seconds)
        simulated.grow(True)
        try:
            before, sims_before = cpu(pids), cpu([simulated.process.pid])
            rss_start, _ = memory(pids)
            time.sleep(seconds)
            after, sims_after = cpu(pids), cpu([simulated.process.pid])
            rss, pss = memory(pids)
            count = threads(pids)
            window = time.time() - opened
            setup.windows.append((opened, time.time()))
        finally:
            simulated.grow(False)
    complaints = {key: list(counts) for key, counts in idle.complaints.items()}
    for key, (total, inside) in setup.complaints.items():
        merged = complaints.setdefault(key, [0, 0])
        merged[0] += total
        merged[1] += inside
    return Result(
        name, len(pids), setup.warmup, window, after - before, count, rss_start, rss, pss, setup.watch, idle,
        complaints, (sims_after - sims_before).total,
    )  # fmt: skip


# -- the report ------------------------------------------------------------------------------


def _ms(values: list[float]) -> str:
    if not values:
        return "none"
    values = sorted(values)
    p95 = values[min(len(values) - 1, math.ceil(0.95 * len(values)) - 1)]
    return f"{statistics.median(values) * 1000:7.0f} {p95 * 1000:7.0f} {values[-1] * 1000:7.0f}"


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a is not None and b else "n/a"


def _row(label: str, a: float, b: float, digits: int = 0) -> None:
    print(f"  {label:<56} {a:9.{digits}f} {b:9.{digits}f}   {_ratio(a, b)}")


def report(one: Result, separate: Result, speedup: float, every: float) -> None:
    """Print the figures of both setups, side by side, and the three ratios."""
    results = (one, separate)
    accounts = len(one.watch.accounts)
    intervals = {"bills": 900 / speedup, "usage": 300 / speedup}
    due = {r.name: {s: accounts * r.window / i for s, i in intervals.items()} for r in results}
    done = {r.name: {s: len(r.watch.freshness[s]) for s in intervals} for r in results}

    def per_hour(pick: Callable[[Result], float]) -> tuple[float, float]:
        a, b = (pick(r) / r.window * 3600 for r in results)
        return a, b

    print(f"CPU-seconds per hour at the intervals ÷ {speedup:g}{'':<20}one process {separate.processes:>3} processes")
    _row("all", *per_hour(lambda r: r.cpu.total))
    _row("  threads that ended (the HTTP server's: our scrapes)", *per_hour(lambda r: r.cpu.ended))
    rest = per_hour(lambda r: r.cpu.live)
    _row("  the rest (refreshes, alerts, scheduler, accept loop)", *rest)
    scraped, quiet = (one.idle.scraped, separate.idle.scraped), (one.idle.quiet, separate.idle.quiet)
    print("the rest between refreshes: a launch at the default intervals, once its first refreshes are done")
    _row("idle A: scraped as above", *scraped)
    _row("idle B: not scraped", *quiet)
    print("CPU-seconds per hour at the default intervals: the rest ÷ speed-up assumes the refresh work dominates")
    print("it; idle B + (the rest − idle A) ÷ speed-up scales only the refreshes (and counts no scrapes)")
    plain = (rest[0] / speedup, rest[1] / speedup)
    _row(f"the rest ÷ {speedup:g}", *plain, digits=1)
    default = (quiet[0] + max(0.0, rest[0] - scraped[0]) / speedup, quiet[1] + max(0.0, rest[1] - scraped[1]) / speedup)
    _row(f"idle B + (the rest − idle A) ÷ {speedup:g}", *default, digits=1)
    per_refresh = [max(0.0, r - s) / 3600 * x.window / max(1, sum(done[x.name].values()))
                   for r, s, x in zip(rest, scraped, results, strict=True)]  # fmt: skip
    due_per_hour = accounts * sum(3600 / (i * speedup) for i in intervals.values())
    print(f"or per refresh: idle B + (the rest − idle A) ÷ refreshes done × the {due_per_hour:.0f} due per hour (right")
    print(
        "if the mix of bills and usage refreshes done is the schedule's; when one is BEHIND, the others understate it)"
    )
    _row(
        f"idle B + (the rest − idle A) × {due_per_hour:.0f} ÷ refreshes done",
        quiet[0] + per_refresh[0] * due_per_hour,
        quiet[1] + per_refresh[1] * due_per_hour,
        digits=1,
    )
    print("refreshes seen done in the window ÷ due (accounts × window ÷ the interval; a window's edge may cut one)")
    for r in results:
        counts = ", ".join(f"{s} {done[r.name][s]} ÷ {due[r.name][s]:.0f}" for s in intervals)
        behind = [s for s in intervals if r.watch.oldest[s] > BEHIND * intervals[s] * (1 + JITTER)]
        note = (
            f"  — BEHIND ({', '.join(behind)}): data got older than {BEHIND:g} × (interval + jitter)" if behind else ""
        )
        print(f"  {r.name:<28} {counts}{note}")
    for r in results:
        attempts = r.watch.scrapes + r.watch.failures
        cost = r.cpu.ended / attempts * 1000 if attempts else math.nan
        print(f"  {r.name}: {attempts} scrapes in {r.window:.0f} s, {cost:.1f} ms CPU each; "
              f"{r.cpu.total / r.window:.0%} of a core in all; {r.threads} threads at the end; the simulators' "
              f"process {r.simulators / r.window:.0%} of a core")  # fmt: skip
    print("refresh duration, ms: the exporter's own inference_exporter_refresh_duration_seconds of each refresh seen")
    print(f"  {'':<30} {'refreshes':>9} {'median':>7} {'p95':>7} {'max':>7}")
    for r in results:
        for source, values in r.watch.durations.items():
            if values:
                print(f"  {r.name + ' ' + source:<30} {len(values):9d} {_ms(values)}")
    print(f"memory, MB{'':<52}one process  sum of {separate.processes:>3}")
    _row("VmRSS at the window's start", one.rss_start, separate.rss_start)
    _row("VmRSS at the window's end", one.rss, separate.rss)
    if one.pss is not None and separate.pss is not None:
        _row("PSS at the end (shared pages split between processes)", one.pss, separate.pss)
    print(f"freshness, ms: first seen on /metrics − last success timestamp (each exporter scraped every {every:g} s)")
    print(f"  {'':<30} {'changes':>9} {'median':>7} {'p95':>7} {'max':>7}")
    for r in results:
        everything = [v for values in r.watch.freshness.values() for v in values]
        print(f"  {r.name:<30} {len(everything):9d} {_ms(everything)}")
        for source, values in r.watch.freshness.items():
            if values:  # (history: checked every 600 s, past the window)
                print(f"    {source:<28} {len(values):9d} {_ms(values)}")
        print(f"    {'scrape response time':<28} {r.watch.scrapes:9d} {_ms(r.watch.responses)}")
        if r.watch.failures:
            print(f"    scrapes failed (no answer within 10 s, Prometheus' default scrape_timeout): {r.watch.failures}")
    print(f"oldest data at any scrape, s: the scrape's time − the last success (the schedule's jitter adds up to "
          f"{intervals['bills'] * JITTER:g} s | {intervals['usage'] * JITTER:g} s to the interval)")  # fmt: skip
    print(f"  {'':<30} {'bills':>7} {'usage':>7}")
    for r in results:
        print(f"  {r.name:<30} {r.watch.oldest['bills']:7.1f} {r.watch.oldest['usage']:7.1f}")
    for source in AGED:
        worse = [
            one.watch.oldest_per_account.get((a, source), 0.0) - separate.watch.oldest_per_account.get((a, source), 0.0)
            for a in one.watch.accounts
        ]
        print(f"  accounts whose {source} got older in the one process than alone: {sum(w > 0 for w in worse)} "
              f"of {len(worse)} (by {max(worse, default=0.0):+.1f} s at most)")  # fmt: skip
    for r in results:
        for complaint, (count, inside) in sorted(r.complaints.items(), key=lambda item: -item[1][0]):
            print(f"  {r.name} logged {count} × {complaint}  ({inside} in the measured windows)")
    fresh = [statistics.median([v for vs in r.watch.freshness.values() for v in vs] or [math.nan]) for r in results]
    print(f"CPU one ÷ separate: {_ratio(*default)} (target < 1)  [idle B + (the rest − idle A) ÷ {speedup:g}; "
          f"the rest ÷ {speedup:g} alone: {_ratio(*plain)}]")  # fmt: skip
    print(f"RSS one ÷ separate: {_ratio(one.rss, separate.rss)} (target < 1)")
    print(f"freshness median one ÷ separate: {_ratio(*fresh)} (target ≤ 1)")


@contextlib.contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl-C, so that every process started is stopped."""

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--accounts", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=120.0, help="the measured window")
    parser.add_argument("--speedup", type=float, default=30.0, help="the default intervals ÷ this")
    parser.add_argument("--records", type=int, default=2000, help="usage records per account today at the start")
    parser.add_argument("--scrape-every", type=float, default=0.2, help="seconds between scrapes of each exporter")
    parser.add_argument("--idle-seconds", type=float, default=60.0, help="between refreshes: half scraped, half not")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        _serve_simulators(args.serve, args.records)
        return
    width = max(2, len(str(args.accounts)))
    names = tuple(f"acct-{n:0{width}d}" for n in range(1, args.accounts + 1))
    print(f"{args.accounts} accounts: one exporter process, then {args.accounts} exporter processes of one account "
          f"each, against the same {args.accounts} simulators (one helper process; {args.records:,} usage records "
          f"each at the start, {ENDPOINTS} endpoints, 1-10 more records every {GROWTH_EVERY:g} s in the sped-up "
          f"windows); each setup at the default intervals for {args.idle_seconds:g} s between refreshes, then at the "
          f"intervals ÷ {args.speedup:g} (bills {900 / args.speedup:g} s, usage {300 / args.speedup:g} s; history "
          f"kept: 3 months, at start-up and then every 600 s) for a window of {args.seconds:g} s; each after every "
          f"account's first refresh of bills, usage and history; on {os.cpu_count()} cores")  # fmt: skip
    with _sigterm_unwinds(), simulators(args.accounts, args.records) as simulated:
        sims = simulated.infos
        results = []
        for name, start in (
            ("one process", lambda d, speedup: start_one(d, names, sims, speedup)),
            (f"{args.accounts} processes", lambda d, speedup: start_separate(d, names, sims, speedup)),
        ):
            idle = measure_idle(name, partial(start, speedup=1.0), names, args.scrape_every, args.idle_seconds)
            print(f"  {name} at the default intervals: warm-up {idle.warmup:.1f} s, settled {idle.settle:.1f} s later; "
                  f"then {args.idle_seconds:g} s measured")  # fmt: skip
            busy = partial(start, speedup=args.speedup)
            result = measure_busy(name, busy, names, args.scrape_every, args.seconds, idle, simulated)
            print(f"  {name} at the intervals ÷ {args.speedup:g}: warm-up {result.warmup:.1f} s, window "
                  f"{result.window:.1f} s from {idle.settle:.1f} s later")  # fmt: skip
            results.append(result)
    report(results[0], results[1], args.speedup, args.scrape_every)


if __name__ == "__main__":
    main()
