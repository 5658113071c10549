"""The ``hf-kvpolicies`` model for lm-evaluation-harness: ``import hf_kvpolicies.lm_eval`` registers
it, then ``lm_eval.simple_evaluate(model="hf-kvpolicies", model_args={"pretrained": ...,
"policy": "window:window=256", "protocol": "prefill"}, ...)`` runs lm-eval's tasks through the
policy (``pip install 'hf-kvpolicies[lm-eval]'``).

The model lives with the evaluation harness (:mod:`eval.lm_eval.model`), whose protocols and exact
streaming it shares; this module only hands it on, and nothing else in the library imports it.
"""

from eval.lm_eval.model import PolicyLM

__all__ = ["PolicyLM"]
