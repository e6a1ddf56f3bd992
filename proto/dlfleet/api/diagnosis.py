"""Failure diagnosis: which rule a failed worker matches, and what to do.

The rules are data (`diagnosis_rules.yaml` beside this file, versioned; a
job adds its own from job.yaml, tried first). `diagnose(facts, table)` is a
pure function of what the agent knows about one failure: the exit code or
signal, the error file's message and traceback, the tail of stderr, whether
the kernel's OOM killer struck, whether the step watchdog fired, the
exception of this node's previous failure, how many of the node's ranks
failed with the same exception, and whether the node ever got past its first
training step.
The first rule whose every condition holds decides; the table always ends
with a rule that matches anything, so every failure gets exactly one verdict.

Imports no torch: the agent, the master (validating job.yaml) and tests use it.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import yaml

RULES_PATH = Path(__file__).with_name("diagnosis_rules.yaml")
TABLE_VERSION = 1
ANY_EXCEPTION = "any"
# How the master's refusal of a join begins once its restart-loop breaker gave
# up (the agent then exits as a node whose workers failed, not as one lost).
RESTART_LOOP_REFUSAL = "restart loop:"
# "Traceback ...\n  ...\nValueError: bad" / "torch.OutOfMemoryError: ..." / "KeyboardInterrupt"
_EXCEPTION_LINE = re.compile(
    r"^(?:[A-Za-z_][\w]*\.)*([A-Za-z_]\w*(?:Error|Exception|Interrupt|Exit))\b"
)
_RANK_PREFIX = re.compile(r"^\[(?:default)?rank\d+\]:\s*")
_TEXT_LIMIT = 64 * 1024  # of each text searched: the end of it, where errors are


class Category(enum.Enum):
    USER_ERROR = "user_error"
    OUT_OF_MEMORY = "out_of_memory"
    HARDWARE = "hardware"
    NETWORK = "network"
    PREEMPTED = "preempted"
    HUNG = "hung"
    KILLED = "killed"
    UNKNOWN = "unknown"


class Action(enum.Enum):
    FAIL_JOB = "fail_job"
    REPLACE_NODE = "replace_node"
    RELAUNCH_NODE_WITH_MORE_MEMORY = "relaunch_node_with_more_memory"
    RESTART = "restart"


class RuleError(ValueError):
    """A rule table that cannot be used; the message names the rule and the field."""


@dataclass(frozen=True)
class FailureFacts:
    """What the agent knows of one failed worker."""

    exit_code: int = 0
    signal: str = ""  # "SIGKILL"; empty when it exited by itself
    message: str = ""  # the error file's message, else a summary
    traceback: str = ""
    stderr_tail: str = ""
    oom_killed: bool = False
    hung: bool = False
    previous_exception: str = ""  # `exception_signature` of this node's previous failure
    # The most training steps a rank of this node reported before the failure
    # (over all its attempts); None: unknown (the script reports no progress).
    steps: int | None = None
    ranks: int = 1  # the node's local ranks
    ranks_alike: int = 1  # of them, those that failed with this same exception
    # The master's restart-loop breaker found the job failing again at the
    # same step after every restore, down to the oldest step it could restore.
    restart_loop: bool = False

    @property
    def before_first_step(self) -> bool | None:
        """Whether no rank of the node ever finished a training step (None:
        unknown). `ShardedDataLoader` counts a step when it hands out a batch,
        so one step counted means the first is still under way."""
        return None if self.steps is None else self.steps <= 1

    @property
    def every_rank(self) -> bool:
        """Every local rank (two or more) failed with the same exception."""
        return self.ranks >= 2 and self.ranks_alike >= self.ranks and bool(self.signature)

    @property
    def exception(self) -> str:
        """The exception named last in the traceback, message or stderr ("" if none)."""
        for text in (self.traceback, self.message, self.stderr_tail):
            name = exception_name(text)
            if name:
                return name
        return ""

    @property
    def signature(self) -> str:
        """The exception and the first line of its message: equal for a repeat."""
        return exception_signature(self.traceback, self.message, self.stderr_tail)


@dataclass(frozen=True)
class Conditions:
    text: tuple[re.Pattern[str], ...] = ()
    exception: tuple[str, ...] = ()
    signal: tuple[str, ...] = ()
    exit_code: tuple[int, ...] = ()
    oom_killed: bool | None = None
    hung: bool | None = None
    repeated: bool | None = None
    before_first_step: bool | None = None
    every_rank: bool | None = None
    restart_loop: bool | None = None

    def hold(self, facts: FailureFacts) -> bool:
        if self.text and not _any_found(self.text, facts):
            return False
        if self.exception:
            name = facts.exception
            if not name or (ANY_EXCEPTION not in self.exception and name not in self.exception):
                return False
        if self.signal and facts.signal not in self.signal:
            return False
        if self.exit_code and (facts.signal or facts.exit_code not in self.exit_code):
            return False
        flags = (
            (self.oom_killed, facts.oom_killed),
            (self.hung, facts.hung),
            (self.repeated, bool(facts.signature) and facts.signature == facts.previous_exception),
            (self.every_rank, facts.every_rank),
            (self.restart_loop, facts.restart_loop),
        )
        if not all(wanted is None or wanted == actual for wanted, actual in flags):
            return False
        # Unknown (a script that reports no steps) holds neither way.
        return self.before_first_step is None or self.before_first_step == facts.before_first_step


@dataclass(frozen=True)
class Rule:
    name: str
    category: Category
    action: Action
    when: Conditions = field(default_factory=Conditions)


@dataclass(frozen=True)
class Verdict:
    rule: str
    category: Category
    action: Action

    def describe(self) -> str:
        return f"{self.category.value} (rule {self.rule}): {self.action.value}"


@dataclass(frozen=True)
class RuleTable:
    rules: tuple[Rule, ...]
    version: int = TABLE_VERSION

    def with_rules_first(self, extra: Sequence[Rule]) -> RuleTable:
        """This table with `extra` tried before its own rules (a job's rules)."""
        names = [r.name for r in extra]
        if len(set(names)) != len(names):
            raise RuleError(f"diagnosis rules must have distinct names, got {names}")
        return RuleTable((*extra, *self.rules), self.version)


def diagnose(facts: FailureFacts, table: RuleTable | None = None) -> Verdict:
    for rule in (table or default_table()).rules:
        if rule.when.hold(facts):
            return Verdict(rule.name, rule.category, rule.action)
    return Verdict("none-matched", Category.UNKNOWN, Action.RESTART)


@cache
def default_table() -> RuleTable:
    return load_table(yaml.safe_load(RULES_PATH.read_text()), source=str(RULES_PATH))


def restart_only_table() -> RuleTable:
    """Diagnosis off: every failure restarts in place (torchrun's policy)."""
    return RuleTable((Rule("diagnosis-off", Category.UNKNOWN, Action.RESTART),))


def load_table(document: Any, *, source: str = "rules") -> RuleTable:
    """A table from its YAML document ({version, rules: [...]}); RuleError if invalid."""
    if not isinstance(document, Mapping):
        raise RuleError(f"{source}: a rule table is a mapping with `version` and `rules`")
    version = document.get("version")
    if version != TABLE_VERSION:
        raise RuleError(
            f"{source}: rule table version {version!r}, this dlfleet reads {TABLE_VERSION}"
        )
    rules = parse_rules(document.get("rules"), source=source)
    if not rules or rules[-1].when != Conditions():
        raise RuleError(f"{source}: the last rule must match anything (`when: {{}}`)")
    return RuleTable(tuple(rules), version)


def parse_rules(items: Any, *, source: str = "rules") -> list[Rule]:
    """Rules from their YAML/JSON form (a list of mappings); RuleError naming the bad one."""
    if not isinstance(items, list):
        raise RuleError(f"{source}: `rules` must be a list of rules")
    rules = [_parse_rule(item, f"{source}: rule {i}") for i, item in enumerate(items)]
    names = [r.name for r in rules]
    duplicated = sorted({n for n in names if names.count(n) > 1})
    if duplicated:
        raise RuleError(f"{source}: rule names must be distinct, repeated: {duplicated}")
    return rules


def rule_to_json(rule: Rule) -> dict[str, Any]:
    """The YAML/JSON form `parse_rules` reads (to hand rules to an agent)."""
    when: dict[str, Any] = {}
    c = rule.when
    if c.text:
        when["text"] = [p.pattern for p in c.text]
    for key in ("exception", "signal", "exit_code"):
        if getattr(c, key):
            when[key] = list(getattr(c, key))
    for key in _FLAGS:
        if getattr(c, key) is not None:
            when[key] = getattr(c, key)
    return {
        "name": rule.name,
        "category": rule.category.value,
        "action": rule.action.value,
        "when": when,
    }


def exception_signature(*texts: str) -> str:
    """The first of `texts` that names an exception: its line, as Python
    printed it (the exception and its message), at most 300 characters."""
    for text in texts:
        line = _exception_line(text)
        if line:
            return line[:300]
    return ""


def exception_name(text: str) -> str:
    line = _exception_line(text)
    match = _EXCEPTION_LINE.match(line) if line else None
    return match.group(1) if match else ""


# ------------------------------------------------------------------ parsing

_KEYS = {"name", "category", "action", "when"}
_FLAGS = ("oom_killed", "hung", "repeated", "before_first_step", "every_rank", "restart_loop")
_WHEN_KEYS = {"text", "exception", "signal", "exit_code", *_FLAGS}


def _parse_rule(item: Any, where: str) -> Rule:
    if not isinstance(item, Mapping):
        raise RuleError(f"{where}: a rule is a mapping with name, category, action and when")
    unknown = sorted(set(item) - _KEYS)
    if unknown:
        raise RuleError(f"{where}: unknown keys {unknown}; a rule has {sorted(_KEYS)}")
    name = item.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[a-z0-9][a-z0-9_.-]{0,62}", name):
        raise RuleError(f"{where}: `name` must be a short lower-case identifier, got {name!r}")
    where = f"{where} ({name})"
    category = _member(Category, item.get("category"), f"{where}: category")
    action = _member(Action, item.get("action"), f"{where}: action")
    when = item.get("when", {})
    if not isinstance(when, Mapping):
        raise RuleError(f"{where}: `when` must be a mapping of conditions")
    unknown = sorted(set(when) - _WHEN_KEYS)
    if unknown:
        raise RuleError(f"{where}: unknown conditions {unknown}; known: {sorted(_WHEN_KEYS)}")
    return Rule(name, category, action, _conditions(when, where))


def _conditions(when: Mapping[str, Any], where: str) -> Conditions:
    patterns = []
    for text in _strings(when, "text", where):
        try:
            patterns.append(re.compile(text, re.IGNORECASE | re.MULTILINE))
        except re.error as exc:
            raise RuleError(
                f"{where}: text pattern {text!r} is not a regular expression: {exc}"
            ) from None
    signals = _strings(when, "signal", where)
    bad = [s for s in signals if not re.fullmatch(r"SIG[A-Z0-9]+", s)]
    if bad:
        raise RuleError(f"{where}: signals are named like SIGKILL, got {bad}")
    codes = when.get("exit_code", [])
    if not isinstance(codes, list) or not all(
        isinstance(c, int) and not isinstance(c, bool) for c in codes
    ):
        raise RuleError(f"{where}: `exit_code` must be a list of integers, got {codes!r}")
    flags: dict[str, bool | None] = {}
    for key in _FLAGS:
        value = when.get(key)
        if value is not None and not isinstance(value, bool):
            raise RuleError(f"{where}: `{key}` must be true or false, got {value!r}")
        flags[key] = value
    return Conditions(
        text=tuple(patterns),
        exception=tuple(_strings(when, "exception", where)),
        signal=tuple(signals),
        exit_code=tuple(codes),
        **flags,
    )


def _strings(when: Mapping[str, Any], key: str, where: str) -> list[str]:
    value = when.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise RuleError(f"{where}: `{key}` must be a list of non-empty strings, got {value!r}")
    return list(value)


def _member(kind: type[enum.Enum], value: Any, where: str) -> Any:
    try:
        return kind(value)
    except ValueError:
        known = ", ".join(m.value for m in kind)
        raise RuleError(f"{where} {value!r} is not one of: {known}") from None


def _exception_line(text: str) -> str:
    """The last line of `text` that names an exception, as Python prints it
    (torch's "[rank3]: " prefix of a worker's stderr line aside)."""
    for line in reversed(text[-_TEXT_LIMIT:].splitlines()):
        stripped = _RANK_PREFIX.sub("", line.strip())
        if _EXCEPTION_LINE.match(stripped):
            return stripped
    return ""


def _any_found(patterns: Sequence[re.Pattern[str]], facts: FailureFacts) -> bool:
    texts = [t[-_TEXT_LIMIT:] for t in (facts.message, facts.traceback, facts.stderr_tail) if t]
    return any(p.search(t) for p in patterns for t in texts)
