"""Text to evaluate on: the embedded CPython reference manual, Hub datasets, or a local file.

Hub datasets and local files go through the same ``datasets.load_dataset`` path (a local file
through the packaged ``text`` builder, which needs no network), so a user who has the Hub and
one who has only a file get their text the same way, cached by ``datasets`` alike.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from hf_kvpolicies.special_tokens import start_ids

EMBEDDED_TEXT = "pydoc"


class DataError(ValueError):
    """A dataset or text file that cannot be used; the message names the fix."""


@dataclass(frozen=True)
class HubDataset:
    """A text dataset on the Hugging Face Hub, joined into one stream of documents."""

    path: str
    config: str | None
    split: str
    column: str = "text"
    separator: str = "\n\n"

    def describe(self) -> str:
        return f"{self.path}" + (f"/{self.config}" if self.config else "") + f" ({self.split})"


HUB_DATASETS: dict[str, HubDataset] = {
    "wikitext2": HubDataset("Salesforce/wikitext", "wikitext-2-raw-v1", "test"),
    "pg19": HubDataset("emozilla/pg19-test", None, "test"),  # PG-19's 100 test books, as parquet
}
DATASETS = (EMBEDDED_TEXT, *HUB_DATASETS)


def embedded_text() -> str:
    """CPython's reference manual (``pydoc_data.topics``), in a fixed topic order.

    It ships with every CPython, so it needs no download; it differs between Python
    versions, so results record :func:`embedded_text_version`.
    """
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))


def embedded_text_version() -> str:
    return f"pydoc_data.topics (CPython {platform.python_version()})"


def check_dataset(name: str) -> str:
    if name not in DATASETS:
        raise DataError(
            f"unknown dataset {name!r}: choose one of {', '.join(DATASETS)}, or pass a local file with --text-file PATH"
        )
    return name


def text_label(dataset: str = EMBEDDED_TEXT, text_file: str | Path | None = None) -> str:
    """Where :func:`load_text` takes the text from (it goes into every result record), read
    without loading it, so that a sweep with nothing left to run loads nothing."""
    if text_file is not None:
        return f"file:{Path(text_file).resolve()}"
    check_dataset(dataset)
    if dataset == EMBEDDED_TEXT:
        return embedded_text_version()
    return f"{dataset}: {HUB_DATASETS[dataset].describe()}"


def load_text(dataset: str = EMBEDDED_TEXT, text_file: str | Path | None = None) -> tuple[str, str]:
    """``(text, label)``: the text of ``text_file`` when given, else of the named dataset, and
    :func:`text_label`."""
    label = text_label(dataset, text_file)
    if text_file is not None:
        return _local_text(Path(text_file)), label
    if dataset == EMBEDDED_TEXT:
        return embedded_text(), label
    source = HUB_DATASETS[dataset]
    try:
        rows = _load(source.path, source.config, split=source.split)
    except Exception as error:  # datasets raises ConnectionError, FileNotFoundError, HfHubHTTPError...
        raise DataError(
            f"cannot load dataset {dataset!r} ({source.describe()}) from the Hugging Face Hub "
            f"({type(error).__name__}: {_first_line(error)}); with no Hub access, pass a local file with --text-file PATH"
        ) from error
    return source.separator.join(rows[source.column]), label


def _local_text(path: Path) -> str:
    if not path.is_file():
        raise DataError(f"--text-file {str(path)!r} does not exist or is not a file: pass the path of a UTF-8 text file")
    try:
        rows = _load("text", data_files=str(path.resolve()), split="train", sample_by="document")
    except Exception as error:
        raise DataError(
            f"cannot read --text-file {str(path)!r} as text ({type(error).__name__}: {_first_line(error)}): "
            "pass a UTF-8 text file"
        ) from error
    text = "\n\n".join(rows["text"])
    if not text.strip():
        raise DataError(f"--text-file {str(path)!r} is empty: pass a file with text in it")
    return text


def _load(path: str, config: str | None = None, **kwargs):
    import datasets  # imported here: it takes a second, and the embedded text does not need it

    return datasets.load_dataset(path, config, **kwargs)


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else "no message"


def tokenize(tokenizer: PreTrainedTokenizerBase, text: str, count: int | None = None, start: bool = True) -> torch.Tensor:
    """``[1, count]`` token ids of ``text`` (all of it when ``count`` is None), opening with the
    tokenizer's :func:`start_ids` (counted in ``count``) unless ``start=False`` (a haystack that
    is cut into prompts, not a model input itself).

    For a count, a prefix of the text is tried first: tokenizing a whole book to use its
    first thousand tokens would cost more than the evaluation.
    """
    opening = torch.tensor([start_ids(tokenizer) if start else []], dtype=torch.long)
    if count is not None:
        wanted = count - opening.shape[1]
        prefix = text[: 8 * wanted + 1024]
        ids = tokenizer(prefix, return_tensors="pt", add_special_tokens=False).input_ids
        if ids.shape[1] < wanted + 64 and len(prefix) < len(text):  # the cut must stay clear of the tokens kept
            ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
        if ids.shape[1] < wanted:
            raise DataError(f"the text has {ids.shape[1]} tokens, fewer than the {wanted} asked for")
        return torch.cat([opening, ids[:, :wanted]], dim=1)
    return torch.cat([opening, tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids], dim=1)
