"""Loading a config: YAML → `${VAR}`/`${file:PATH}` → the schema (`exporter.config.schema`) → checks across sections.

`${VAR}` anywhere in a string is replaced from the environment. Every problem is reported at
once with its location (`billing.page_size: must be ≤ 500`; a misspelt key with the keys of its
place spelt most like it); secrets are `SecretStr` and never appear in a message.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from exporter.config.checks import cross_check, items, location, rule_name
from exporter.config.rules import label_twins, twin_rules
from exporter.config.schema import Config, keys_at, secret_fields
from exporter.core.decimals import WrittenFloat
from exporter.core.fields import url_password
from exporter.core.lognames import MASK
from exporter.core.typed import ValidationError
from exporter.notifiers.webhook import webhook_secret

MISSING_TOLD = 1000
"""The most places a `${VAR}` or `${file:}` that cannot be filled is told at where YAML's aliases
and merges repeat it, in a document (every place written in the file is told; in a document built
in code, one string object at many places counts as repeated there)."""
MAX_NESTING = 100
"""The deepest a config's mappings and lists may nest (no config needs a tenth of it)."""
REFERENCE = re.compile(r"\$\{(?:file:([^}]+)|([A-Za-z_][A-Za-z0-9_]*))\}")
"""`${VAR}` (an environment variable) or `${file:PATH}` (a file's content, e.g. a mounted secret)."""
RULE_KINDS = ("threshold-rule", "budget-rule", "anomaly-rule")
"""The tags of a rule's types, which a validation error's location holds."""
LIKE = 0.6
"""How alike (difflib's ratio) an unknown key and a known one must be for "did you mean"."""
NEAR_TIE = 0.05
"""Known keys this close to the likest one are offered with it."""


class ConfigError(Exception):
    """Every problem found in a config, each as `location: message`."""

    def __init__(self, details: list[str]) -> None:
        super().__init__("\n".join(details))
        self.details = details


_NOT_FOR_KIND = {
    "budget-rule": "does not apply to a budget rule (it fires once per tier per period)",
    "threshold-rule": "does not apply to a threshold rule (a rule has either `signal` with `threshold`, "
    "or `budget` with `tiers`)",
    "anomaly-rule": "does not apply to a spend_anomaly rule (it has `by`, `min_amount`, `min_percent` and "
    "`sensitivity`: see the README)",
}
"""Messages for a key of the other kind of rule (an error's location has the kind after the rule's index)."""


# --- checks across sections (on the document, so they run whatever else is wrong) ------------


if TYPE_CHECKING:
    _SafeLoader = yaml.SafeLoader
else:  # libyaml's parser where PyYAML has it: ten times faster than PyYAML's own
    _SafeLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class StrictLoader(_SafeLoader):
    """Safe YAML that refuses a key given twice in one mapping."""


class _PyYAMLStrictLoader(yaml.SafeLoader):
    """`StrictLoader` on PyYAML's own parser, whose words for a syntax error are clearer (it names an
    undefined alias, for one)."""


MERGE = "tag:yaml.org,2002:merge"


def _refuse_repeats(loader: StrictLoader, node: yaml.MappingNode) -> None:
    """ConstructorError for a key written twice in `node` (`<<` too), or in a mapping its `<<`
    merges in; a key written beside `<<` overrides what it merges in, as YAML has it. Each mapping
    is looked at once a document (an anchor merged in many times, at many levels, costs once)."""
    checked: set[int] = loader.__dict__.setdefault("_checked", set())
    if id(node) in checked:
        return
    checked.add(id(node))
    seen: set[Any] = set()
    for key_node, value_node in node.value:
        if key_node.tag == MERGE:
            key: Any = "<<"
            merged = value_node.value if isinstance(value_node, yaml.SequenceNode) else [value_node]
            for mapping in merged:
                if isinstance(mapping, yaml.MappingNode):
                    _refuse_repeats(loader, mapping)
        else:
            key = loader.construct_object(key_node)
            if isinstance(key, dict | list):
                raise yaml.constructor.ConstructorError(
                    None, None, "a key must be a plain value, not a mapping or a list", key_node.start_mark
                )
        if key in seen:
            raise yaml.constructor.ConstructorError(None, None, f"key {key!r} is given twice", key_node.start_mark)
        seen.add(key)


def _mapping(loader: StrictLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    """A mapping whose keys are each written once (`_refuse_repeats`)."""
    _refuse_repeats(loader, node)
    loader.flatten_mapping(node)
    return loader.construct_mapping(node)


def _float(loader: StrictLoader, node: yaml.ScalarNode) -> WrittenFloat:
    """A float that keeps the text it was written as (an amount stays exact: `parse_decimal`)."""
    value = WrittenFloat(loader.construct_yaml_float(node))
    value.written = str(node.value)
    return value


for _loader in (StrictLoader, _PyYAMLStrictLoader):
    _loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)
    _loader.add_constructor("tag:yaml.org,2002:float", _float)


def parse_yaml(text: str) -> Any:
    """The document in `text` (`StrictLoader`); yaml.YAMLError if it is none, told as PyYAML's own
    parser tells it where that finds the fault too."""
    try:
        return yaml.load(text, Loader=StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except RecursionError:  # (lists or mappings nested hundreds deep)
        raise yaml.YAMLError("nested too deeply") from None
    except yaml.YAMLError as error:
        try:
            yaml.load(text, Loader=_PyYAMLStrictLoader)  # noqa: S506 - a SafeLoader subclass
        except yaml.YAMLError as told:
            raise told from None
        except RecursionError:  # (nested deeper than PyYAML's parser can go: libyaml's error says so)
            pass
        raise error from None


_QUOTED = re.compile(r"'[^']*'")
_QUOTING = (
    "found undefined alias",
    "could not determine a constructor",
    "found undefined tag",
    "found duplicate anchor",
)
"""PyYAML's problems that quote a name from the file: an alias (`*name`), a tag (`!name`), an anchor (`&name`)."""


def yaml_problem(error: yaml.YAMLError) -> str:
    """What PyYAML found wrong, without the names from the file it quotes: a password written by
    mistake that starts with `*`, `!` or `&` is read as an alias, a tag or an anchor."""
    problem = getattr(error, "problem", None)
    if not isinstance(problem, str):
        return str(error) if str(error) == "nested too deeply" else "not YAML"
    return _QUOTED.sub("(its name not repeated here)", problem) if problem.startswith(_QUOTING) else problem


def substitute(
    node: Any, environ: Mapping[str, str], path: tuple[int | str, ...], missing: dict[tuple[int | str, ...], str]
) -> Any:
    """Replace `${VAR}` and `${file:PATH}` in every string; note in `missing` why a path could not be
    filled. A mapping or list that YAML's aliases give in several places (and a value a merge key,
    `<<`, copies) is done once and shared, as YAML shares it: ten aliases of ten aliases, nested
    eight deep, are 10^8 values. What could not be filled is told at every place written in the
    file, and at MISSING_TOLD places at most where aliases and merges repeat it. RecursionError
    past MAX_NESTING."""
    return _Filling(environ, missing).value(node, path, 0)


class _Filling:
    """One document's substitution (see `substitute`): each container and string done once, by id."""

    def __init__(self, environ: Mapping[str, str], missing: dict[tuple[int | str, ...], str]) -> None:
        self.environ, self.missing = environ, missing
        self.made: dict[int, Any] = {}
        self.lacking: dict[int, bool] = {}
        """Per container done: whether something in it could not be filled."""
        self.height: dict[int, int] = {}
        """Per container done: how deep it nests (an alias of it, deep down, nests deeper)."""
        self.strings: dict[int, tuple[str, str, str | None]] = {}
        """Per string done: itself (held, so its id stays its own), what it was filled as, and why it
        could not be (None: it was)."""
        self.repeats = 0

    def value(self, node: Any, path: tuple[int | str, ...], depth: int) -> Any:
        if isinstance(node, dict | list):
            if depth > MAX_NESTING:
                raise RecursionError("nested too deeply")  # (told as such by `load_checked`)
            if id(node) in self.made:  # (an alias of it: what it lacks is told here too, as repeats allow)
                if depth + self.height[id(node)] > MAX_NESTING:
                    raise RecursionError("nested too deeply")
                if self.lacking[id(node)]:
                    self._tell_again(node, path)
                return self.made[id(node)]
            pairs = list(node.items() if isinstance(node, dict) else enumerate(node))
            filled = [(key, self.value(value, (*path, key), depth + 1)) for key, value in pairs]
            self.made[id(node)] = dict(filled) if isinstance(node, dict) else [value for _, value in filled]
            self.lacking[id(node)] = any(self._lacks(value) for _, value in pairs)
            self.height[id(node)] = 1 + max((self.height.get(id(value), 0) for _, value in pairs), default=0)
            return self.made[id(node)]
        if not isinstance(node, str):
            return node
        done = self.strings.get(id(node))
        if done is None:
            done = self.strings[id(node)] = (node, *_filled(node, self.environ))
            if done[2] is not None:
                self.missing.setdefault(path, done[2])
        elif done[2] is not None:  # (a merge's copy of a value written elsewhere)
            self._tell_repeat(path, done[2])
        return done[1]

    def _lacks(self, value: Any) -> bool:
        if isinstance(value, dict | list):
            return self.lacking.get(id(value), False)
        return isinstance(value, str) and self.strings[id(value)][2] is not None

    def _tell_again(self, node: dict[Any, Any] | list[Any], path: tuple[int | str, ...]) -> None:
        """What could not be filled in a container met again, told at `path`, while repeats allow:
        only the parts that lack something are walked (a repeat of 10^8 values that lack nothing
        costs nothing)."""
        for key, value in node.items() if isinstance(node, dict) else enumerate(node):
            if self.repeats >= MISSING_TOLD:
                return
            if isinstance(value, dict | list):
                if self.lacking.get(id(value)):
                    self._tell_again(value, (*path, key))
            elif isinstance(value, str) and (why := self.strings[id(value)][2]) is not None:
                self._tell_repeat((*path, key), why)

    def _tell_repeat(self, path: tuple[int | str, ...], why: str) -> None:
        if self.repeats < MISSING_TOLD:
            self.repeats += 1
            self.missing.setdefault(path, why)


def _filled(text: str, environ: Mapping[str, str]) -> tuple[str, str | None]:
    """`text` with its references filled, and why one could not be (the first), or None."""
    problems: list[str] = []

    def replace(match: re.Match[str]) -> str:
        if match[1] is not None:
            try:
                return Path(match[1]).read_text(encoding="utf-8").strip()
            except OSError as error:
                problems.append(f"cannot read secret file {match[1][:200]} ({error.strerror})")
            except UnicodeDecodeError:
                problems.append(f"secret file {match[1]} is not UTF-8 text")
            except ValueError:  # (a path holding a NUL)
                problems.append(f"cannot read secret file {match[1][:200]!r} (not a file name)")
            return match[0]
        if match[2] not in environ:
            problems.append(f"environment variable {match[2]} is not set")
            return match[0]
        return environ[match[2]].strip()  # (as a file's: a secret's trailing newline goes no further)

    return REFERENCE.sub(replace, text), problems[0] if problems else None


def _at_path(node: Any, path: tuple[int | str, ...]) -> Any:
    for part in path:
        node = node[part]
    return node


def secret_warnings(raw: Any, path: Path) -> list[str]:
    """Secrets written into the config file itself rather than taken from the environment or a file.
    A warning is about the file at `path` and does not name it: who shows it does, once."""
    warnings = []
    notifiers = list(items(raw if isinstance(raw, dict) else {}, "alerts", "notifiers"))
    addresses = [  # (a webhook's token, or a password for basic auth in any notifier's address)
        ((*where, key, index) if key == "urls" else (*where, key), url)
        for where, item in notifiers
        for key in ("url", "urls")
        for index, url in enumerate(item[key] if isinstance(item.get(key), list) else [item.get(key)])
        if isinstance(url, str)
        and (url_password(url) or (key == "url" and item.get("type") == "webhook" and webhook_secret(url)))
    ]
    for where, value in [*secret_fields(Config, raw), *addresses]:
        if isinstance(value, str) and value and not REFERENCE.search(value):
            warnings.append(
                f"{location(where)}: a secret is written in the config file; use ${{VAR}} or ${{file:PATH}}"
            )
    warnings = list(dict.fromkeys(warnings))  # (an address that is a secret key's too, a Slack URL's: once)
    if warnings and path.stat().st_mode & stat.S_IROTH:
        warnings.append("the file is world-readable and holds secrets (chmod o-r)")
    return warnings


_MESSAGES = {
    "missing": "required key is missing",
    "extra_forbidden": "unknown key",
    "int_type": "not an integer",
    "int_parsing": "not an integer",
    "int_from_float": "not an integer",
    "bool_type": "not true or false",
    "bool_parsing": "not true or false",
    "string_type": "not a string",
    "dict_type": "not a mapping",
    "model_type": "not a mapping",
    "tuple_type": "not a list",
    "string_too_short": "must not be empty",
    "too_short": "must not be empty",
    "float_type": "not a number",
    "float_parsing": "not a number",
}


def _message(error: Any) -> str:
    kind = error["type"]
    context = error.get("ctx") or {}
    if kind in _MESSAGES:
        return _MESSAGES[kind]
    if kind == "less_than_equal":
        return f"must be ≤ {context['le']}"
    if kind == "greater_than_equal":
        return f"must be ≥ {context['ge']}"
    if kind == "literal_error":
        return f"must be one of {context['expected']}"
    if kind == "union_tag_invalid":
        return f"unknown type {context['tag']!r} (expected one of {context['expected_tags']})"
    if kind == "union_tag_not_found":
        return "missing `type`"
    if kind == "string_pattern_mismatch":
        return "contains characters that are not allowed"
    if kind == "value_error":
        return str(context.get("error", error["msg"]))
    return str(error["msg"])


def _unknown_key(document: dict[str, Any], loc: tuple[int | str, ...], path: tuple[int | str, ...]) -> str:
    """Why the key at `loc` is refused: a key of another kind of rule says so; another gets the
    keys of its place that are spelt most like it (the ones not given already)."""
    key, place = str(loc[-1]), loc[:-1]
    if place[:2] == ("alerts", "rules") and len(place) == 4:
        other_kinds = [kind for kind in RULE_KINDS if kind != place[3]]
        if any(key in keys_at((*place[:3], kind)) for kind in other_kinds):
            return _NOT_FOR_KIND[str(place[3])]
    try:
        given = _at_path(document, path[:-1])
    except (KeyError, IndexError, TypeError):
        given = None
    given = given if isinstance(given, dict) else {}
    import difflib  # (here, as `ast` below: only a config with problems needs them)

    likeness = {k: difflib.SequenceMatcher(None, key, k).ratio() for k in keys_at(place) if k not in given}
    best = max(likeness.values(), default=0.0)
    if best < LIKE:
        return "unknown key"
    close = [k for k, ratio in sorted(likeness.items(), key=lambda pair: -pair[1]) if ratio >= best - NEAR_TIE]
    return f"unknown key; did you mean {' or '.join(close)}?"


def validate(raw: Any, environ: Mapping[str, str] | None = None) -> Config:
    environ = os.environ if environ is None else environ
    missing: dict[tuple[int | str, ...], str] = {}
    document = substitute(raw if raw is not None else {}, environ, (), missing)
    if not isinstance(document, dict):
        raise ConfigError(["(top level): the config must be a mapping"])
    errors = [f"{location(path)}: {problem}" for path, problem in missing.items()]
    for _, rule in items(document, "alerts", "rules"):  # `budget: null` beside `signal` means no budget
        for key in ("signal", "budget"):
            if key in rule and rule[key] is None:
                del rule[key]
    try:
        config = Config.model_validate(document)
    except ValidationError as invalid:
        for error in invalid.errors():
            path = tuple(
                "for" if p == "for_" else p
                for n, p in enumerate(error["loc"])
                if not (isinstance(p, str) and (p.endswith("Notifier") or p in RULE_KINDS))
                and not (n == 3 and error["loc"][:2] == ("alerts", "notifiers"))  # the `type` it was read as
            )
            if path not in missing:
                unknown = error["type"] == "extra_forbidden"
                message = _unknown_key(document, error["loc"], path) if unknown else _message(error)
                errors.append(f"{location(path)}{rule_name(document, path)}: {message}")
    errors += cross_check(document, tolerant=bool(errors))  # (values of the wrong kind, named above, may be about)
    if not errors:
        for earlier, later in twin_rules(config.alerts.rules):
            path = ("alerts", "rules", later)
            errors.append(
                f"{location(path)}{rule_name(document, path)}: makes the same alerts as alerts.rules[{earlier}]"
                " (the same alert name, what it watches and labels); give one of them other `labels`, a severity"
            )
        errors += _alike_to_alertmanager(config, document)
    if errors:
        raise ConfigError(_masked(errors, document))
    return config


def _alike_to_alertmanager(config: Config, document: dict[str, Any]) -> list[str]:
    """Rules whose alerts can have the same labels (`label_twins`) and go to one `alertmanager`
    notifier: it would take the one's alert for the other's, and never notify the second."""
    rules = config.alerts.rules
    routed = config.rule_routes()
    managers = {n.name for n in config.alerts.notifiers if n.type == "alertmanager"}
    errors, told = [], set()
    for earlier, later in label_twins(rules):
        shared = managers & set(routed[earlier]) & set(routed[later])
        if shared and later not in told:  # (a rule is told once, with the first it clashes with)
            told.add(later)
            path = ("alerts", "rules", later)
            errors.append(
                f"{location(path)}{rule_name(document, path)}: its alerts can have the same labels as those of"
                f" alerts.rules[{earlier}] (the same alert name, `labels` and `by`: `where`, `signal` and `window`"
                f" make no label), and Alertmanager ({', '.join(sorted(shared))}) tells alerts apart by their labels"
                " only: it would take the one's for the other's. Give each its own `labels` (e.g. a `scope`), or"
                " `by` what tells them apart"
            )
    return errors


MASKED_QUOTED_FROM, MASKED_FROM = 4, 12
"""The shortest secret masked in a quoted value, and anywhere in a message (where a shorter one, a
placeholder such as `test`, would mask pieces of words)."""
QUOTED = re.compile(r"'((?:[^'\\]|\\.)*)'")
"""A value a message quotes (`repr`'s form)."""


def _masked(errors: list[str], document: dict[str, Any]) -> list[str]:
    """`errors` with the document's secrets masked (`***`): a message may quote a value of another
    key that the same ${VAR} or ${file:} filled (a time zone, an address), which is then a secret;
    or a part of it (a value cut short). A quoted value that holds a secret, or is a long part of one,
    is masked whole; a secret standing as a word of its own (`known: a, SECRET`) is masked, and a long
    one wherever it is, escaped as `repr` and JSON write it too."""
    found = {value for _, value in secret_fields(Config, document) if isinstance(value, str)}
    secrets = [s for s in found if len(s) >= MASKED_QUOTED_FROM]

    def quoted(match: re.Match[str]) -> str:
        value = match[1]
        try:
            import ast

            unescaped = ast.literal_eval(match[0])  # (as repr wrote it)
        except (ValueError, SyntaxError):
            unescaped = value
        for secret in secrets:
            for seen in {value, unescaped}:
                if secret in seen or (len(seen) >= MASKED_FROM and seen in secret):
                    return f"'{MASK}'"
        return match[0]

    forms = {form for s in secrets if len(s) >= MASKED_FROM for form in (s, repr(s)[1:-1], json.dumps(s)[1:-1])}
    words = [re.compile(rf"(?<![\w.-]){re.escape(s)}(?![\w.-])") for s in sorted(secrets, key=len, reverse=True)]
    masked = []
    for error in errors:
        error = QUOTED.sub(quoted, error)
        for form in sorted(forms, key=len, reverse=True):
            error = error.replace(form, MASK)
        for word in words:
            error = word.sub(MASK, error)
        masked.append(error)
    return masked


def load(path: str | Path, environ: Mapping[str, str] | None = None) -> Config:
    """Load and validate a config file; warnings about secrets written in it go to the log."""
    from exporter.core.logs import get_logger  # (here: `check` and `rules` start without logging)

    config, warnings = load_checked(path, environ)
    for warning in warnings:
        get_logger(__name__).warning("config warning", path=str(path), detail=warning)
    return config


def load_checked(path: str | Path, environ: Mapping[str, str] | None = None) -> tuple[Config, list[str]]:
    """The validated config and the warnings about it (secrets written in the file), each without
    the file's name (`path: warning: …` is the caller's to write)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as error:
        raise ConfigError([f"{path}: cannot read ({error.strerror})"]) from None
    except UnicodeDecodeError as error:
        raise ConfigError([f"{path}: not UTF-8 text (byte {error.start + 1} cannot be read)"]) from None
    try:
        raw = parse_yaml(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        hint = ""
        if mark and text[mark.index : mark.index + 1] == "{" and text[mark.index - 1 : mark.index] == "$":
            hint = ' (a ${VAR} inside { } or [ ] is written quoted: "${VAR}")'
        raise ConfigError([f"{where}: invalid YAML: {yaml_problem(error)}{hint}"]) from None
    try:
        return validate(raw, environ), secret_warnings(raw, Path(path))
    except RecursionError:  # (lists nested hundreds deep: libyaml reads them, the checks recurse)
        raise ConfigError([f"{path}: invalid YAML: nested too deeply"]) from None
