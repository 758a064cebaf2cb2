"""Small helpers the tests share: scraping, waiting on a condition with a deadline."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import requests
from prometheus_client.parser import text_string_to_metric_families

T = TypeVar("T")
Series = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(exposition: str) -> Series:
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(exposition)
        for sample in family.samples
    }


def scrape(url: str, **kwargs: object) -> Series:
    response = requests.get(f"{url}/metrics", timeout=10, **kwargs)  # type: ignore[arg-type]
    response.raise_for_status()
    return parse(response.text)


def value(series: Series, name: str, **labels: str) -> float | None:
    return series.get((name, frozenset(labels.items())))


def named(series: Series, name: str) -> dict[frozenset[tuple[str, str]], float]:
    return {labels: v for (n, labels), v in series.items() if n == name}


def wait_for(condition: Callable[[], T], timeout: float = 20.0, interval: float = 0.05) -> T:
    """Poll `condition` until it returns something truthy; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(interval)
