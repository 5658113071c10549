"""``hf-kvpolicies lm-eval ARGS``: lm-evaluation-harness's own command line, every flag passed
through, with the ``hf-kvpolicies`` model registered (lm-eval finds only its own models)."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence

from ..settings import UsageError

INSTALL = "pip install 'hf-kvpolicies[lm-eval]'"


def run_lm_eval(argv: Sequence[str]) -> int:
    """Run ``lm-eval ARGV``; a bad argument of the hf-kvpolicies model is a :class:`UsageError`."""
    if importlib.util.find_spec("lm_eval") is None:
        raise UsageError(f"lm-eval is not installed: {INSTALL}")
    from lm_eval.__main__ import cli_evaluate

    from .arguments import ModelArgumentError
    from .model import PolicyLM  # noqa: F401  (registers the model)

    saved, sys.argv = sys.argv, ["lm-eval", *argv]
    try:
        cli_evaluate()
    except ModelArgumentError as error:
        raise UsageError(str(error)) from None
    finally:
        sys.argv = saved
    return 0
