"""The tasks the sweep and the report know, by the names they answer to."""

from __future__ import annotations

from .base import Task

TASKS: list[Task] = []
"""Every registered task, in the order their columns appear in a table."""


def register_task(task: Task) -> None:
    """Make ``task`` known to ``--task``, the sweep and the report."""
    if not task.name or any(known.name == task.name for known in TASKS):
        raise ValueError(f"a task needs a name of its own; {task.name!r} is empty or taken")
    TASKS.append(task)


def task_for(name: str) -> Task:
    """The task that ``--task name`` (or a record's task) belongs to; ``ValueError`` if none."""
    for task in TASKS:
        if task.accepts(name):
            return task
    raise ValueError(f"unknown task {name!r}: choose one of {', '.join(task_names())}")


def task_names() -> list[str]:
    """What ``--task`` takes, task by task."""
    return [name for task in TASKS for name in task.names()]


def check_task_name(name: str) -> str:
    """``name`` if a task takes it (options included), else ``ValueError`` naming the fix."""
    task_for(name).check_name(name)
    return name
