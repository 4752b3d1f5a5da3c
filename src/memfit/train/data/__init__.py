"""Training data: read local files in common instruction formats, validate them, tokenize with
label masks, pack, and batch.

Typical use by a training loop::

    records, fmt = load_records("data.jsonl")                           # DataError lists problems
    examples = tokenize_records(records, tokenizer, seq_len=256)        # labels -100 off-response
    batches = BatchIterator(examples, batch_size=8, seed=0)             # resumable order
    batch = collate(next(batches), tokenizer.pad_token_id)             # memfit.step.batch: tensors

Heavy dependencies stay lazy: pyarrow is imported when a Parquet file is read; this package never
imports torch or transformers (it is handed a tokenizer).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from memfit.train.data.batching import BatchIterator
from memfit.train.data.chat import DEFAULT_CHAT_TEMPLATE, ChatTemplateError, render_chat, render_prompt
from memfit.train.data.errors import DataError
from memfit.train.data.formats import FORMATS, detect_format, load_records
from memfit.train.data.tokenization import pack_examples, tokenize_records

__all__ = [
    "BatchIterator",
    "ChatTemplateError",
    "DEFAULT_CHAT_TEMPLATE",
    "DataError",
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
