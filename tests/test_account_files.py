"""Which state file each account keeps its sources' state in (`files_for`): the file follows the
billing account whatever its name; a key rotated under a name keeps the name's file."""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path

import pytest

from exporter.state import StateStore, peek_account_files
from exporter.state.accounts import AccountFile, files_for

A, B, C = "a" * 32, "b" * 32, "c" * 32
"""Three billing accounts' ids."""


def files(accounts: dict[str, str], *known: tuple[str, str, str]) -> dict[str, tuple[str, str, str]]:
    return {name: tuple(f)[:3] for name, f in files_for(accounts, [AccountFile(*k) for k in known]).items()}


@pytest.mark.parametrize(
    ("accounts", "known", "expected"),
    [
        pytest.param({"": A}, [], {"": ("", A, "")}, id="one account, first start"),
        pytest.param({"prod": A, "lab": B}, [], {"prod": ("prod", A, "prod"), "lab": ("lab", B, "lab")},
                     id="several, first start: each its name's file, as versions before kept them"),
        pytest.param({"production": A}, [("prod", A, "prod")], {"production": ("prod", A, "production")},
                     id="renamed"),
        pytest.param({"prod": A}, [("", A, "")], {"prod": ("", A, "prod")}, id="moved under accounts"),
        pytest.param({"": B}, [("prod", A, "prod"), ("staging", B, "staging")], {"": ("staging", B, "")},
                     id="one of several, back to one account"),
        pytest.param({"prod": B, "staging": A}, [("prod", A, "prod"), ("staging", B, "staging")],
                     {"prod": ("staging", B, "prod"), "staging": ("prod", A, "staging")}, id="swapped"),
        pytest.param({"prod": C}, [("prod", A, "prod")], {"prod": ("prod", C, "prod")}, id="key rotated"),
        pytest.param({"production": A, "prod": C}, [("prod", A, "prod")],
                     {"production": ("prod", A, "production"), "prod": (f"prod.{C[:8]}", C, "prod")},
                     id="renamed, and another account given the name"),
        pytest.param({"production": A, "prod": C}, [("prod", A, "production")],
                     {"production": ("prod", A, "production"), "prod": (f"prod.{C[:8]}", C, "prod")},
                     id="the name given to another account after the rename"),
        pytest.param({"a": A, "b": A}, [("a", A, "a"), ("b", A, "b")], {"a": ("a", A, "a"), "b": ("b", A, "b")},
                     id="two accounts alike keep theirs by name"),
        pytest.param({"b": A}, [("a", A, "a"), ("b", A, "b")], {"b": ("b", A, "b")},
                     id="one of two alike left: its own"),
        pytest.param({"prod": A, "staging": B}, [("prod", A, "prod"), ("staging", B, "staging"), ("lab", C, "lab")],
                     {"prod": ("prod", A, "prod"), "staging": ("staging", B, "staging")},
                     id="unchanged, a removed account's file left as it is"),
        pytest.param({"lab": C}, [("prod", A, "prod"), ("lab", C, "staging")], {"lab": ("lab", C, "lab")},
                     id="added back under another name: its file"),
        pytest.param({"production": A, "prod": C}, [("prod", A, "prod"), (f"prod.{C[:8]}", B, "staging")],
                     {"production": ("prod", A, "production"), "prod": (f"prod.{C[:8]}.2", C, "prod")},
                     id="a file of the name and id marked taken too"),
        pytest.param({"": C}, [("", A, "prod")], {"": (C[:8], C, "")},
                     id="one account of another key, the process's file another's"),
    ],
)  # fmt: skip
def test_each_account_keeps_the_file_of_its_billing_account(
    accounts: dict[str, str], known: list[tuple[str, str, str]], expected: dict[str, tuple[str, str, str]]
) -> None:
    assert files(accounts, *known) == expected


def test_no_two_accounts_share_a_file() -> None:
    """Whatever the files known, the accounts configured get one each."""
    known = [("prod", A, "staging"), ("staging", B, "prod"), ("", C, "lab"), (f"prod.{C[:8]}", A, "x")]
    for accounts in ({"prod": C, "staging": C, "lab": A}, {"": B}, {"prod": A, "x": B, "lab": C, "y": A}):
        got = [f.file for f in files_for(accounts, [AccountFile(*k) for k in known]).values()]
        assert len(set(got)) == len(got) == len(accounts)


@pytest.mark.parametrize(
    ("configs", "name", "expected"),
    [
        pytest.param([{"prod": A}, {"production": A, "prod": C}, {"prod": A}, {"prod": B}], "prod", "prod",
                     id="a key rotated under a reused name keeps the file used last under it"),
        pytest.param([{"a": A, "b": A}, {"b": A}, {"a": A}], "a", "b",
                     id="alike, one left, renamed: the file it used last"),
        pytest.param([{"prod": A, "lab": A}, {"prod": A, "lab": C}, {"prod": C, "lab": A}], "lab", "prod",
                     id="alike, then another key, then swapped: the file it used last"),
        pytest.param([{"a": A, "b": A}, {"": A}, {"b": A}], "b", "a",
                     id="alike, then one account, then under a name again"),
    ],
)  # fmt: skip
def test_an_account_goes_on_in_the_file_it_used_last(configs: list[dict[str, str]], name: str, expected: str) -> None:
    """Through a state file, config after config."""
    store = StateStore(":memory:")
    for accounts in configs:
        used = files_for(accounts, store.account_files())
        store.record_account_files(used.values())
    assert used[name].file == expected


def test_a_state_file_an_earlier_version_wrote_last_has_no_files_and_no_complaint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Read beside (the `digest` command): a file without `account_files` names no files, quietly
    (the accounts' files are then their names)."""
    path = tmp_path / "state.db"
    with contextlib.closing(sqlite3.connect(path)) as db:
        db.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
    assert peek_account_files(path) == []
    assert not caplog.records
