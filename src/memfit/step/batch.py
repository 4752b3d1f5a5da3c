"""A micro-batch as the step takes it: padded rows, or every example in one row with its bounds.

How a micro-batch is laid out decides memory: ``[batch, longest]`` padded rows carry padding
tokens and an attention mask that transformers turns into a ``[batch, 1, seq, seq]`` tensor, while
one row of all the examples (``documents``) holds exactly their tokens and keeps attention inside
each example through :mod:`memfit.step.attention`. The trainer collates its data with
:func:`collate`; the planner builds its batch with the same function, so both run the same layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from memfit.step.labels import IGNORE_INDEX

#: The layouts :func:`collate` makes.
PADDED, DOCUMENTS = "padded", "documents"


@dataclass(frozen=True)
class Documents:
    """Where the examples of a one-row micro-batch start and end.

    ``cu_seqlens`` (int32, ``[n + 1]``, on the batch's device) holds the cumulative lengths, as
    variable-length attention kernels take them; ``lengths`` the same as Python ints, so that the
    step can loop over examples without reading the device.
    """

    cu_seqlens: torch.Tensor
    lengths: tuple[int, ...]

    @property
    def max_length(self) -> int:
        return max(self.lengths)

    @property
    def total(self) -> int:
        return sum(self.lengths)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Documents:
        return Documents(self.cu_seqlens.to(device, non_blocking=non_blocking), self.lengths)


def collate(examples: Sequence[dict[str, Any]], pad_token_id: int, *, layout: str = PADDED) -> dict[str, Any]:
    """The micro-batch of ``examples`` (each ``input_ids`` and ``labels``, packed rows also
    ``position_ids``) as int64 tensors on the host.

    ``layout="padded"``: right-padded ``[batch, longest]`` rows; ``input_ids`` padded with
    ``pad_token_id``, ``labels`` with -100 (padding is never trained), ``position_ids`` (packed rows)
    with 0, and an ``attention_mask`` (1 on real tokens) only when some row is padded: an all-ones
    mask would only make the model check it.

    ``layout="documents"``: every example in one ``[1, tokens]`` row, no padding. An example (or a
    run of a packed row whose positions do not restart) is a document: ``position_ids`` restart at
    its start, its first label is -100 (that token would be predicted from the previous document),
    and ``documents`` (:class:`Documents`) says where each one is, so attention stays inside it.
    """
    if not examples:
        raise ValueError("collate got an empty batch")
    if not isinstance(pad_token_id, int) or isinstance(pad_token_id, bool) or pad_token_id < 0:
        raise ValueError(
            f"pad_token_id must be a non-negative integer, got {pad_token_id!r}; "
            "use tokenizer.pad_token_id, or tokenizer.eos_token_id when the tokenizer has no pad token"
        )
    for row, example in enumerate(examples):
        if len(example["labels"]) != len(example["input_ids"]):
            raise ValueError(
                f"example {row} has {len(example['input_ids'])} input_ids but {len(example['labels'])} labels"
            )
    if layout == DOCUMENTS:
        return _one_row(examples)
    if layout != PADDED:
        raise ValueError(f"layout: {layout!r} is not one of {PADDED}, {DOCUMENTS}")
    return _padded(examples, pad_token_id)


def _padded(examples: Sequence[dict[str, Any]], pad_token_id: int) -> dict[str, Any]:
    import numpy as np

    lengths = [len(example["input_ids"]) for example in examples]
    longest = max(lengths)
    with_positions = all("position_ids" in example for example in examples)
    size = (len(examples), longest)
    input_ids = torch.full(size, pad_token_id, dtype=torch.long)
    labels = torch.full(size, IGNORE_INDEX, dtype=torch.long)
    position_ids = torch.zeros(size, dtype=torch.long) if with_positions else None
    for row, example in enumerate(examples):
        length = lengths[row]
        # (Through numpy: a long row converts many times faster than from a Python list. A tensor
        # from a new array is what torch.tensor makes of a list, without torch.tensor's extra copy.)
        input_ids[row, :length] = torch.from_numpy(np.array(example["input_ids"], dtype=np.int64))
        labels[row, :length] = torch.from_numpy(np.array(example["labels"], dtype=np.int64))
        if position_ids is not None:
            position_ids[row, :length] = torch.from_numpy(np.array(example["position_ids"], dtype=np.int64))
    out: dict[str, Any] = {"input_ids": input_ids, "labels": labels}
    if any(length < longest for length in lengths):
        attention_mask = torch.zeros(size, dtype=torch.long)
        for row, length in enumerate(lengths):
            attention_mask[row, :length] = 1
        out["attention_mask"] = attention_mask
    if position_ids is not None:
        out["position_ids"] = position_ids
    return out


def _one_row(examples: Sequence[dict[str, Any]]) -> dict[str, Any]:
    # The row is put together in numpy (a 100k-token row is many times faster than in Python
    # lists); each tensor is then made from its new array as torch.tensor makes it from a list.
    import numpy as np

    input_ids, labels, positions, lengths = [], [], [], []
    for example in examples:
        ids = np.asarray(example["input_ids"], dtype=np.int64)
        labs = np.array(example["labels"], dtype=np.int64)
        given = example.get("position_ids")
        given = None if given is None else np.asarray(given, dtype=np.int64)
        starts = [0] + ((np.flatnonzero(given[1:] == 0) + 1).tolist() if given is not None else [])
        for begin, end in zip(starts, starts[1:] + [len(ids)]):
            lengths.append(end - begin)
            labs[begin] = IGNORE_INDEX
            positions.append(given[begin:end] if given is not None else np.arange(end - begin, dtype=np.int64))
        input_ids.append(ids)
        labels.append(labs)
    cu_seqlens = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu_seqlens[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
    return {
        "input_ids": torch.from_numpy(np.concatenate(input_ids)[None]),
        "labels": torch.from_numpy(np.concatenate(labels)[None]),
        "position_ids": torch.from_numpy(np.concatenate(positions)[None]),
        "documents": Documents(cu_seqlens, tuple(lengths)),
    }


def to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """The batch on ``device`` (tensors and :class:`Documents` moved; other values kept)."""
    return {k: v.to(device, non_blocking=True) if hasattr(v, "to") else v for k, v in batch.items()}


def count_tokens(batch: dict[str, Any]) -> int:
    """Input tokens of a batch, padding not counted."""
    if "attention_mask" in batch:
        return int(batch["attention_mask"].sum())
    return int(batch["input_ids"].numel())


def labelled_tokens(labels: torch.Tensor) -> int:
    """Tokens a causal LM loss scores in a batch: labels shifted by one, those marked ignored left out."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())
