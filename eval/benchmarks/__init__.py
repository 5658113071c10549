"""One-command benchmarks, one module per question (``python -m eval.benchmarks.NAME``)."""
