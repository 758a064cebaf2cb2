"""Counts in words people read: `1 probe`, `2 probes`, never `1 probes`."""

from __future__ import annotations


def counted(count: int, noun: str, plural: str = "") -> str:
    """`count` and `noun` agreeing with it (`plural`, when adding an `s` does not make it)."""
    return f"{count:,} {noun if count == 1 else plural or noun + 's'}"
