"""Tasks of the sweep: one module each, registered here in the order of their table columns.

A new task is a module with a :class:`~eval.tasks.base.Task` subclass and one line below.
"""

from . import lm_eval, memory, perplexity, qa, recall, speed
from .base import Bench, Column, Curves, Job, Measure, Panel, Row, Task, Unit
from .registry import TASKS, check_task_name, register_task, task_for, task_names

for _task in (perplexity.TASK, memory.TASK, speed.TASK, recall.TASK, qa.TASK, lm_eval.TASK):
    register_task(_task)

__all__ = [
    "TASKS", "Bench", "Column", "Curves", "Job", "Measure", "Panel", "Row", "Task", "Unit",
    "check_task_name", "register_task", "task_for", "task_names",
]
