"""The lm-evaluation-harness backend: the ``hf-kvpolicies`` model that scores and generates
through a policy cache (:mod:`.model`, which needs lm-eval), the project's tasks written as
lm-eval tasks (:mod:`.export`), and lm-eval's results read back as records (:mod:`.results`).

Only :mod:`.model` and :mod:`.command` import lm-eval (an optional dependency); the rest, and
this package, load without it, so the report reads lm-eval's results wherever it runs.
"""
