"""Training data: local files and Hugging Face Hub datasets in common instruction formats, read in
memory or as a stream, validated, tokenized with label masks, packed, mixed, and batched.

Typical use by a training loop::

    records, fmt = load_records("data.jsonl")                           # DataError lists problems
    examples = tokenize_records(records, tokenizer, seq_len=256)        # labels -100 off-response
    batches = BatchIterator(examples, batch_size=8, seed=0)             # resumable order
    batch = collate(next(batches), tokenizer.pad_token_id)             # memfit.step.batch: tensors

A config's sources (:class:`DataSource`: paths, Hub ids, subsets, splits, column mappings,
weights) are read by :func:`~memfit.train.data.reading.load_sources`, or opened as a stream by
:func:`~memfit.train.data.reading.open_stream` (:class:`~memfit.train.data.stream.StreamBatches`).

A local folder laid out as a Hub dataset repository (``data/train-*.parquet``, ``test.jsonl``, a
README's ``configs:``) is read as ``datasets`` reads it, its splits included
(:mod:`~memfit.train.data.folders`).

Heavy dependencies stay lazy: ``datasets`` (and pyarrow) is imported when a Hub dataset, a local
folder, a Parquet or Arrow file, a mix or a stream is read, never for a local JSON, JSON Lines or
CSV file; this package never imports torch or transformers (it is handed a tokenizer).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from memfit.train.data.chat import DEFAULT_CHAT_TEMPLATE, ChatTemplateError, render_chat, render_prompt
from memfit.train.data.errors import DataError
from memfit.train.data.formats import FORMATS, detect_format, load_records
from memfit.train.data.order import BatchIterator
from memfit.train.data.sources import DataSource
from memfit.train.data.tokenization import pack_examples, tokenize_records

__all__ = [
    "BatchIterator",
    "ChatTemplateError",
    "DEFAULT_CHAT_TEMPLATE",
    "DataError",
    "DataSource",
    "FORMATS",
    "detect_format",
    "load_records",
    "pack_examples",
    "render_chat",
    "render_prompt",
    "tiny_tokenizer_path",
    "tokenize_records",
]


def tiny_tokenizer_path() -> Path:
    """Directory of the small byte-level BPE tokenizer shipped with memfit (512 tokens, chat
    template included), for tests and demos: ``AutoTokenizer.from_pretrained(tiny_tokenizer_path())``
    works offline."""
    path = Path(str(resources.files("memfit") / "assets" / "tokenizer"))
    if not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(
            f"the tiny tokenizer is missing from {path}; reinstall memfit, or regenerate it with "
            "python scripts/make_tiny_tokenizer.py"
        )
    return path
