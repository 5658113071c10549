"""The evaluation harness: perplexity, memory, speed and recall of KV-cache policies."""
