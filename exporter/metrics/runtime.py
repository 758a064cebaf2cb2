"""The process's own series, as the client library's default registry has them, and what this build is.

`RUNTIME_COLLECTORS` are client_python's defaults (`process_*` from /proc on Linux, `python_info`, `python_gc_*`):
the same objects its default registry holds, served from this exporter's own registries. They have no snapshot
`version`, so the exposition renders them on each scrape (their figures move by themselves).
"""

from __future__ import annotations

import functools
import json
import os
import platform
from collections.abc import Mapping
from importlib import metadata

from prometheus_client import GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR
from prometheus_client.registry import Collector

from exporter import __version__

RUNTIME_COLLECTORS: tuple[Collector, ...] = (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR)
DISTRIBUTION = "inference-cost-exporter"
REVISION_ENV = "INFERENCE_COST_EXPORTER_REVISION"
"""The source revision, set where the image is built (`ARG REVISION` → `ENV INFERENCE_COST_EXPORTER_REVISION`)."""
UNKNOWN = "unknown"


def _installed() -> metadata.Distribution | None:
    try:
        return metadata.distribution(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return None


def revision(environ: Mapping[str, str] = os.environ, distribution: metadata.Distribution | None = None) -> str:
    """The source revision this runs from: REVISION_ENV when set; else the commit pip recorded when it installed the
    distribution from a VCS URL (PEP 610's direct_url.json); else `unknown`."""
    if environ.get(REVISION_ENV, "").strip():
        return environ[REVISION_ENV].strip()
    found = distribution if distribution is not None else _installed()
    text = found.read_text("direct_url.json") if found is not None else None
    try:
        commit = json.loads(text or "{}").get("vcs_info", {}).get("commit_id")
    except (ValueError, AttributeError):  # not JSON, or not the shape PEP 610 gives it
        return UNKNOWN
    return commit if isinstance(commit, str) and commit else UNKNOWN


@functools.cache
def build_labels() -> tuple[str, str, str]:
    """`inference_exporter_build_info`'s version, revision and python_version; found at the first scrape, once."""
    return __version__, revision(), platform.python_version()
