"""The task interface: what a task plugs into the sweep (its jobs, their parameters and units, how
it runs) and into the report (what it checks in its records, its columns, its plotted measures).

The sweep knows tasks only through :class:`Task`; the report reads records back into
:class:`Row` objects and asks each task for its :class:`Column`, :class:`Measure` and
:class:`Curves`. A new task is one module with a :class:`Task` subclass, registered in
:mod:`eval.tasks` (the recipe is in ``docs/evaluation.md``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers.cache_utils import Cache

from ..budgets import PolicyRun
from ..fields import Schema
from ..protocols import PROTOCOLS
from ..settings import Settings
from ..stats import Interval


@dataclass(frozen=True)
class Job:
    """One record to make: a policy run, a task name (as given: ``niah_single:value=word``), the
    run's place in the sweep, and the job's place along its task's dimensions and protocol."""

    run: PolicyRun
    task: str
    index: int
    """The policy run's place in the sweep: tables keep that order whoever ran the job."""
    where: tuple[tuple[str, Any], ...] = ()
    """``(("length", 512), ("protocol", "prefill"))``: the job's value of each dimension of its task
    (:attr:`Task.dimensions`), then its protocol (``"any"`` for a policy the protocol cannot change)."""

    def at(self, name: str) -> Any:
        return dict(self.where).get(name)

    @property
    def length(self) -> int | None:
        return self.at("length")

    @property
    def protocol(self) -> str | None:
        return self.at("protocol")


@dataclass
class Bench:
    """What the tasks of one process run with: the settings, the model and its inputs."""

    settings: Settings
    model: Any
    tokenizer: Any
    ids: torch.Tensor
    """The stream: ``[1, n]`` token ids, as many as the longest :meth:`Task.stream_tokens`."""
    text: str
    """The text the stream was cut from (recall's haystacks come from it)."""
    samples: list[dict]
    """The QA samples of a QA dataset (none otherwise)."""
    memo: dict[Hashable, Any] = field(default_factory=dict)

    def cached(self, key: Hashable, make: Callable[[], Any]) -> Any:
        """``make()``, once per process and key (a haystack, a recall case)."""
        if key not in self.memo:
            self.memo[key] = make()
        return self.memo[key]


@dataclass
class Unit:
    """Jobs of one policy run that one process runs together (equal :meth:`Task.unit`), and what
    they share: the spec built for them, the fields every record of theirs carries about the
    cache, and ``shared`` (perplexity and memory: one pass over the stream)."""

    run: PolicyRun
    jobs: list[Job]
    spec: str
    fields: dict
    make: Callable[[], Cache]
    shared: dict[Hashable, Any] = field(default_factory=dict)

    @property
    def desc(self) -> str:
        """The run's label for a progress bar, cut to 40 characters."""
        label = self.run.label
        return label if len(label) < 40 else label[:37] + "..."


@dataclass
class Row:
    """One policy run's records in one section of the report (a setup and setting)."""

    setup: tuple
    policy: str
    index: int
    name: str = ""
    """The run's label: the spec, and the budget or ratio it was swept at."""
    records: dict[tuple[str, tuple], dict] = field(default_factory=dict)
    """The latest record of each task name at each place along its dimensions and protocol; a
    protocol-independent record under each protocol it stands for."""

    def record(self, task: str, *where: Any) -> dict | None:
        return self.records.get((task, where))

    def matching(self, accepts: Callable[[str], bool]) -> list[tuple[str, tuple, dict]]:
        """``(task name, place, record)`` of the records whose task ``accepts`` takes."""
        return [(task, where, record) for (task, where), record in self.records.items() if accepts(task)]

    def approximate(self, task: str) -> bool:
        return any(record.get("approximate") for (name, _), record in self.records.items() if name == task)

    def label(self, task: str | None = None) -> str:
        return (self.name or self.policy) + (" (approx.)" if task is not None and self.approximate(task) else "")

    def any_record(self) -> dict:
        return next(iter(self.records.values()), {})

    @property
    def budget(self) -> int | None:
        """The most tokens a governed layer keeps (``None``: unbounded); for a bounded policy whose
        budget is known only once it runs (fractions of the prompt), the tokens it kept."""
        record = self.any_record()
        if record.get("budget") is None and record.get("bounded"):
            return record.get("kept_tokens")
        return record.get("budget")

    @property
    def family(self) -> str:
        return self.any_record().get("family") or self.policy.partition(":")[0]


def _no_sources(row: Row) -> list[dict]:
    return []


@dataclass(frozen=True)
class Column:
    """A column of a table: its title, a row's value, and where the value comes from."""

    title: str
    task: str
    """What the CSV's ``approximate`` column names when a cell of this column is approximate."""
    value: Callable[[Row], float | None]
    digits: int
    sources: Callable[[Row], list[dict]] = _no_sources
    """The records a row's cell rests on: the cell is approximate if any of them is."""
    interval: Callable[[Row], Interval | None] | None = None
    """A 95% interval shown after the value (recall: bootstrap over the cells)."""
    ratio: bool = True
    """Whether the cell also shows the ratio to the full cache."""

    def approximate(self, row: Row) -> bool:
        return any(record.get("approximate") for record in self.sources(row))


@dataclass(frozen=True)
class Measure:
    """A quality measure of the frontier plots: its name, a row's value, its axis label."""

    name: str
    value: Callable[[Row], float | None]
    ylabel: str
    bytes_record: Callable[[Row], dict | None]
    """The record whose ``held_bytes`` and ``kept_fraction`` are that measure's memory."""
    interval: Callable[[Row], Interval | None] | None = None
    """The 95% interval the tables give for the value, drawn as error bars."""
    protocol: str | None = None
    """The protocol the measure's answers were given under (named in the plot's title)."""


@dataclass(frozen=True)
class Panel:
    """One panel of a :class:`Curves` figure: a line per row."""

    ylabel: str
    points: Callable[[Row], tuple[list[float], list[float]] | None]
    log: bool = False
    smooth: int = 1
    """A moving average of this many points is drawn over the raw values (1: none)."""


@dataclass(frozen=True)
class Curves:
    """A figure of one line per row along a shared x axis (perplexity by position, memory along
    the stream, latency by context), in one or more panels."""

    name: str
    """The file's name without ``.png``."""
    title: str
    xlabel: str
    task: str
    """The task whose approximate figures the legend marks."""
    panels: tuple[Panel, ...]
    log_x: bool = False


class Task:
    """A task of the sweep and its part of the report. Subclasses set the class attributes and
    override what they need; every method has the default a plain task wants."""

    name: str = ""
    """The plug-in's name: the ``--task`` name of a task with one, the suite's for several."""
    summary: str = ""
    """One line for ``--help``."""
    dimensions: tuple[str, ...] = ()
    """Params that make a record of their own at each value (recall: ``length``); each value is
    a column of its own, never part of the setting a table holds."""
    prompted: bool = False
    """Whether a job runs under each ``--protocol`` (a prompt answered through the cache)."""
    fields: Schema = {}
    """What the report reads from this task's records (checked before reading: :mod:`eval.fields`)."""
    paired: tuple[str, ...] = ()
    """Lists of a record that pair up item by item (a curve's positions and values)."""

    # --- names and options -------------------------------------------------------------------
    def names(self) -> tuple[str, ...]:
        """The ``--task`` names this task answers to, for help and errors."""
        return (self.name,)

    def accepts(self, name: str) -> bool:
        """Whether ``--task name`` (or a record's task) is this task's."""
        return name == self.name

    def check_name(self, name: str) -> None:
        """``ValueError`` naming the fix for a ``--task`` name this task accepts but cannot run."""

    def add_arguments(self, parser: argparse._ActionsContainer) -> None:
        """Options of this task for ``hf-kvpolicies eval``; their values land in
        :attr:`Settings.options` by ``dest``."""

    def check(self, settings: Settings) -> None:
        """:class:`~eval.settings.UsageError` for settings this task cannot run with, before
        anything loads."""

    # --- planning ----------------------------------------------------------------------------
    def places(self, settings: Settings, name: str) -> list[dict[str, Any]]:
        """The job's values of :attr:`dimensions`, one dict per job (the sweep adds the protocol)."""
        return [{}]

    def params(self, settings: Settings, job: Job) -> dict:
        """The settings a job's figures depend on, part of its identity (the sweep adds the budget,
        ratio and protocol)."""
        return {}

    def unit(self, job: Job) -> Hashable:
        """Jobs of one policy run with equal units run together, in one process."""
        return self.name

    def context(self, settings: Settings, job: Job) -> int:
        """The tokens a ratio (``--ratios``) is a fraction of."""
        raise NotImplementedError

    def stream_tokens(self, settings: Settings) -> int:
        """Tokens of the stream (:attr:`Bench.ids`) this task reads; 0 for none."""
        return 0

    # --- running -----------------------------------------------------------------------------
    def prepare(self, bench: Bench, jobs: list[Job]) -> None:
        """Checks and inputs before the first long run (recall: the haystack and a case per job)."""

    def run(self, bench: Bench, unit: Unit, jobs: list[Job]) -> Iterator[tuple[Job, dict]]:
        """Measure ``jobs`` (this task's jobs of ``unit``); yield ``(job, figures)`` as each is
        done. The sweep adds what every record carries (setup, policy, params, unit fields)."""
        raise NotImplementedError

    def headline(self, record: dict) -> str:
        """One line of a record's figures, printed as it is written."""
        return ""

    # --- report ------------------------------------------------------------------------------
    def columns(self, rows: list[Row]) -> list[Column]:
        """Columns of the summary table for the rows of one section (none: not measured)."""
        return []

    def details(self, rows: list[Row]) -> list[Column]:
        """Columns of a detail table ``{name}.md|csv`` (recall: each task, length and protocol)."""
        return []

    def measures(self, rows: list[Row]) -> list[Measure]:
        """Quality measures, each plotted against budget and bytes held (``frontier_*.png``)."""
        return []

    def curves(self, rows: list[Row]) -> list[Curves]:
        """Figures of one line per row (``{name}.png``)."""
        return []

    def caption(self, rows: list[Row]) -> list[str]:
        """What the table's caption says of this task's columns."""
        return []

    def import_records(self, folder: Path) -> list[dict]:
        """Records of this task kept elsewhere than ``results.jsonl`` in a results folder (another
        harness's output, converted), read beside it by ``hf-kvpolicies report``."""
        return []


def stands_for(settings: Settings) -> list[str]:
    """The protocols one run of a protocol-independent policy stands for (``"any"``)."""
    return [name for name in settings.protocol if PROTOCOLS[name].lossless_same]


def protocol_fields(job: Job, settings: Settings) -> dict:
    """What a prompted record says of its protocol: the one it ran under, those it stands for,
    whether the policy was independent of it."""
    independent = job.protocol == "any"
    return {
        "protocol_ran": "prefill" if independent else job.protocol,
        "protocols": stands_for(settings) if independent else [job.protocol],
        "protocol_independent": independent,
    }
