"""lm-eval's results files read back as the harness's records, so that ``hf-kvpolicies report``
sets lm-eval tasks beside its own tasks, in tables and frontier plots.

lm-eval writes a ``results_<date>.json`` per run (``--output_path DIR`` puts it under
``DIR/<model>/``): each task's metrics, and the model's ``config``, where the hf-kvpolicies model
adds :data:`SECTION` (the spec built, the protocol, the budget, and per task what the cache held
once the prompts were in). Each task of a run becomes one record ``lm_eval:TASK``. A run of
another lm-eval model (``hf``) is read as the cache it uses, one that keeps every token.
"""

from __future__ import annotations

import json
import math
from datetime import datetime, timezone
from pathlib import Path

from ..protocols import PROTOCOLS, protocol_independent

SECTION = "hf_kvpolicies"
"""The key of ``config`` under which the hf-kvpolicies model describes its cache."""
PREFIX = "lm_eval:"
"""Records of lm-eval tasks are named ``lm_eval:TASK``."""
DATASET = "lm-evaluation-harness tasks"


def read_lm_eval_results(folder: Path) -> list[dict]:
    """A record per task of every lm-eval results file under ``folder``, oldest run first (a
    later run of the same policy and task wins in the report)."""
    runs = sorted(filter(None, map(_run, sorted(folder.rglob("results_*.json")))), key=lambda run: run["date"])
    ran = {run["protocol"] for run in runs if not run["independent"]}
    stands_for = [name for name in PROTOCOLS if name in ran and PROTOCOLS[name].lossless_same]
    order = sorted({(run["bounded"], run["family"], run["budget"] or 0, run["label"]) for run in runs})
    records = []
    for run in runs:
        index = order.index((run["bounded"], run["family"], run["budget"] or 0, run["label"]))
        records += _records(run, index, stands_for or ["prefill"])
    return records


def _run(path: Path) -> dict | None:
    """What the records of one results file share, or ``None`` for a file that is not lm-eval's results."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("results"), dict) or not isinstance(data.get("config"), dict):
        return None
    config = data["config"]
    ours = config.get(SECTION)
    if isinstance(ours, dict):
        described = {key: ours.get(key) for key in ("spec", "built", "budget", "bounded", "governed_layers", "versions")}
        protocol = ours.get("protocol")
        run = {
            **described, "policy": ours.get("policy"), "label": ours.get("label"), "family": ours.get("family"),
            "model": ours.get("model"), "device": ours.get("device"), "dtype": ours.get("dtype"), "protocol": protocol,
            "independent": isinstance(ours.get("spec"), str) and _independent(ours["spec"]), "held": ours.get("tasks") or {},
        }
    else:
        arguments = _model_arguments(config.get("model_args"))
        name = str(config.get("model"))
        run = {
            "policy": name, "label": f"{name} (lm-eval's model)", "family": name, "budget": None, "bounded": False,
            "model": arguments.get("pretrained"), "device": config.get("device") or arguments.get("device"),
            "dtype": str(config.get("model_dtype", "")).removeprefix("torch.") or None, "protocol": "prefill",
            "independent": True, "held": {},
        }
    return {
        **run, "date": data.get("date") if isinstance(data.get("date"), (int, float)) else 0, "path": path, "results": data["results"],
        "groups": data.get("groups") or {}, "shots": data.get("n-shot") or {}, "better": data.get("higher_is_better") or {},
        "limit": config.get("limit"),
    }


def _independent(spec: str) -> bool:
    try:
        return protocol_independent(spec)
    except ValueError:  # a policy this process does not register
        return False


def _model_arguments(value: object) -> dict:
    """``model_args`` as lm-eval keeps them: a dict, or ``key=value,...``."""
    if isinstance(value, dict):
        return value
    pairs = (item.partition("=") for item in str(value or "").split(","))
    return {key.strip(): raw.strip() for key, _, raw in pairs if key.strip()}


def _records(run: dict, index: int, stands_for: list[str]) -> list[dict]:
    common = {
        key: run.get(key)
        for key in ("policy", "label", "family", "model", "device", "dtype", "spec", "built", "budget", "bounded", "governed_layers", "versions")
        if key in run
    }
    protocol = {"protocol": "any", "protocols": stands_for} if run["independent"] else {"protocol": run["protocol"], "protocols": [run["protocol"]]}
    created = datetime.fromtimestamp(run["date"], timezone.utc).isoformat(timespec="seconds")
    records = []
    for task, values in run["results"].items():
        if task in run["groups"] or not isinstance(values, dict):
            continue
        figures = {key: value for key, value in values.items() if "," in key and _is_number(value)}  # "acc,none": metric, filter
        metrics = {key: value for key, value in figures.items() if "_stderr," not in key}
        stderr = {key.replace("_stderr,", ",", 1): value for key, value in figures.items() if "_stderr," in key}
        held = run["held"].get(task) or {}
        records.append({
            **common, **protocol, **{key: held.get(key) for key in ("kept_tokens", "kept_fraction", "held_bytes", "allocated_bytes")},
            "task": PREFIX + task, "gguf_file": None, "dataset": DATASET, "policy_index": index,
            "params": {"num_fewshot": run["shots"].get(task, 0), "limit": run["limit"], "budget": run["budget"], "protocol": protocol["protocol"]},
            "metrics": metrics, "stderr": stderr, "higher_is_better": run["better"].get(task) or {},
            "approximate": False, "created": created, "source": str(run["path"]),
        })
    return records


def _is_number(value: object) -> bool:
    """A finite int or float: lm-eval writes ``"N/A"`` for a stderr it did not take."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
