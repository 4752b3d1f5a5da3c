"""Turn normalized records into token ids and labels; truncate; optionally pack.

Labels follow the Hugging Face causal-LM convention: ``labels`` has the length of ``input_ids``,
holds the token id where the loss is taken and ``IGNORE_INDEX`` (-100) elsewhere, and the model
shifts it by one internally (the logits at position t are scored against ``labels[t + 1]``).
"""

from __future__ import annotations

import bisect
import warnings
from collections.abc import Sequence
from typing import Any

from memfit.step.labels import IGNORE_INDEX
from memfit.train.data.chat import ChatTemplateError, render_chat
from memfit.train.data.errors import DataError, Problems


def tokenize_records(
    records: Sequence[dict[str, Any]],
    tokenizer: Any,
    seq_len: int,
    train_on_inputs: bool = False,
    packing: bool = False,
) -> list[dict[str, list[int]]]:
    """Tokenize normalized records (from :func:`load_records`) into training examples.

    Args:
        records: ``{"messages": [...]}``, ``{"text": str}`` or ``{"prompt": str, "completion": str}``
            records (:func:`~memfit.train.data.formats.load_records`).
        tokenizer: a Hugging Face fast tokenizer. Chat records are rendered with its
            ``chat_template``, or :data:`DEFAULT_CHAT_TEMPLATE` when it has none.
        seq_len: the most tokens in one example (and, with packing, in every row but the last).
            Longer examples are truncated from the end: the start is kept.
        train_on_inputs: also take the loss on system and user tokens (and the template's markers),
            or on a prompt. By default only assistant turns (each with its end marker) and
            completions (with the EOS after them) are trained. Text records are trained on every
            token either way.
        packing: concatenate all examples, separated by EOS, and cut the stream into rows of
            exactly ``seq_len`` tokens (the last row may be shorter). Packed rows also carry
            ``position_ids`` that restart at 0 with each example, see :func:`pack_examples`.

    Returns:
        One dict per example (or per packed row) with ``input_ids`` and ``labels`` (lists of the same
        length, ``labels`` is -100 where no loss is taken), plus ``position_ids`` when packing.
        Examples left with no trained token after truncation are dropped with a warning.

    Raises:
        DataError: bad arguments, a chat template that cannot be masked, or no example left.
    """
    check_tokenization(tokenizer, seq_len)
    problems = Problems()
    examples: list[dict[str, list[int]]] = []
    dropped_sources: list[str] = []
    for record in records:
        try:
            example = tokenize_record(record, tokenizer, seq_len, train_on_inputs)
        except (ChatTemplateError, ValueError) as exc:
            problems.add(record.get("source", "record"), str(exc))
            continue
        if example is None:
            dropped_sources.append(record.get("source", "record"))
            continue
        examples.append(example)
    problems.raise_if_any("the records")

    if dropped_sources:
        warnings.warn(
            f"dropped {len(dropped_sources)} of {len(records)} examples with no trained token within "
            f"seq_len={seq_len} (first: {dropped_sources[0]}); raise seq_len to keep them",
            stacklevel=2,
        )
    if not examples:
        raise DataError(
            f"no example has a trained token within seq_len={seq_len} ({len(records)} records); "
            "raise seq_len or check that the conversations have assistant turns"
        )
    if packing:
        return pack_examples(examples, seq_len, tokenizer.eos_token_id)
    return examples


def check_tokenization(tokenizer: Any, seq_len: Any) -> None:
    """Raise :class:`DataError` for settings no record can be tokenized with (all problems at once)."""
    problems = Problems()
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 2:
        problems.add("seq_len", f"must be an integer of at least 2, got {seq_len!r}")
    if getattr(tokenizer, "eos_token_id", None) is None:
        problems.add("tokenizer", "has no EOS token; set tokenizer.eos_token before tokenizing")
    if not getattr(tokenizer, "is_fast", False):
        problems.add(
            "tokenizer",
            "needs a fast (Rust) tokenizer for character offsets; load it with "
            "AutoTokenizer.from_pretrained(..., use_fast=True)",
        )
    problems.raise_if_any("the tokenization settings")


def tokenize_record(
    record: dict[str, Any], tokenizer: Any, seq_len: int, train_on_inputs: bool = False
) -> dict[str, list[int]] | None:
    """One normalized record as a training example (truncated to ``seq_len``), or None when no
    token of it is trained within ``seq_len``. Raises :class:`ChatTemplateError` for a conversation
    the chat template cannot mask, ValueError for a record of no known form."""
    eos_id = tokenizer.eos_token_id
    if "messages" in record:
        input_ids, labels = _tokenize_chat(record["messages"], tokenizer, train_on_inputs, record.get("train_from", 0))
    elif "text" in record:
        input_ids, labels = _tokenize_text(record["text"], tokenizer, eos_id)
    elif "prompt" in record:
        input_ids, labels = _tokenize_prompt_completion(
            record["prompt"], record["completion"], tokenizer, eos_id, train_on_inputs
        )
    else:
        raise ValueError("neither 'messages', 'text' nor 'prompt'; pass records from load_records()")
    input_ids, labels = truncate(input_ids, labels, seq_len)
    # The label at position 0 is never scored (nothing precedes it), hence labels[1:].
    if all(label == IGNORE_INDEX for label in labels[1:]):
        return None
    return {"input_ids": input_ids, "labels": labels}


def truncate(input_ids: list[int], labels: list[int], seq_len: int) -> tuple[list[int], list[int]]:
    """Keep the first ``seq_len`` tokens: the prompt stays whole and the end of a long response goes."""
    return input_ids[:seq_len], labels[:seq_len]


def _tokenize_text(text: str, tokenizer: Any, eos_id: int) -> tuple[list[int], list[int]]:
    input_ids = list(tokenizer(text, add_special_tokens=True)["input_ids"])
    if not input_ids or input_ids[-1] != eos_id:
        # End every document with EOS so the model learns where text stops (and packing has a
        # separator between documents).
        input_ids.append(eos_id)
    return input_ids, list(input_ids)


def _tokenize_prompt_completion(
    prompt: str, completion: str, tokenizer: Any, eos_id: int, train_on_inputs: bool
) -> tuple[list[int], list[int]]:
    # Tokenized in one piece, as TRL does, so the ids are those of the whole text; the tokens that
    # overlap the completion's characters are trained, as chat turns are (mask_outside_spans).
    text = prompt + completion
    encoding = tokenizer(text, add_special_tokens=True, return_offsets_mapping=True)
    input_ids = list(encoding["input_ids"])
    if train_on_inputs:
        labels = list(input_ids)
    else:
        labels = mask_outside_spans(input_ids, encoding["offset_mapping"], [(len(prompt), len(text))])
    if not input_ids or input_ids[-1] != eos_id:
        # The EOS after the completion is trained: the model learns to stop there.
        input_ids.append(eos_id)
        labels.append(eos_id)
    return input_ids, labels


def _tokenize_chat(
    messages: list[dict[str, str]], tokenizer: Any, train_on_inputs: bool, train_from: int = 0
) -> tuple[list[int], list[int]]:
    text, spans = render_chat(tokenizer, messages, find_assistant_spans=not train_on_inputs, from_turn=train_from)
    # The template writes the BOS token itself where the model expects one, so the tokenizer must
    # not add another.
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    input_ids = list(encoding["input_ids"])
    if train_on_inputs:
        return input_ids, list(input_ids)
    return input_ids, mask_outside_spans(input_ids, encoding["offset_mapping"], spans)


def mask_outside_spans(
    input_ids: Sequence[int], offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]
) -> list[int]:
    """Labels for ``input_ids``: the token id where the token's characters overlap one of the
    ``spans`` (sorted, disjoint ``[start, end)`` character ranges), -100 elsewhere.

    Overlap rather than containment: a token that a tokenizer merged across a span boundary still
    carries response text, so it is trained.
    """
    starts = [start for start, _ in spans]
    labels = []
    for token_id, (token_start, token_end) in zip(input_ids, offsets):
        # The last span starting before this token ends is the only one it can overlap.
        index = bisect.bisect_left(starts, token_end) - 1
        inside = index >= 0 and token_end > token_start and spans[index][1] > token_start
        labels.append(token_id if inside else IGNORE_INDEX)
    return labels


def pack_examples(examples: Sequence[dict[str, list[int]]], seq_len: int, eos_id: int) -> list[dict[str, list[int]]]:
    """Concatenate examples into rows of exactly ``seq_len`` tokens (the last row may be shorter).

    - An EOS separator follows every example that does not already end with EOS; it is never
      trained.
    - The first token of every example is never trained: its prediction would come from the
      previous example.
    - An example that does not fit in the rest of a row continues at the start of the next row.
    - ``position_ids`` restart at 0 with each example. Called with ``position_ids``, no
      ``attention_mask`` and ``use_cache=False``, transformers models keep attention inside each
      example (they detect the restarts and build a block-diagonal causal mask); called with an
      ``attention_mask``, or with a cache, attention crosses example boundaries within a row.
    """
    packer = Packer(seq_len, eos_id)
    rows = [row for example in examples for row in packer.add(example)]
    return rows + packer.flush()


class Packer:
    """:func:`pack_examples` one example at a time, for data that arrives as a stream.

    :meth:`add` returns the rows an example completes; the tokens that do not fill a row yet wait
    for the next example (:meth:`flush` returns them as the last, shorter row). ``state_dict()`` /
    ``load_state_dict()`` carry the waiting tokens across a checkpoint.
    """

    def __init__(self, seq_len: int, eos_id: int) -> None:
        self.seq_len = seq_len
        self.eos_id = eos_id
        self.pending: dict[str, list[int]] = {"input_ids": [], "labels": [], "position_ids": []}

    def add(self, example: dict[str, list[int]]) -> list[dict[str, list[int]]]:
        input_ids, labels = list(example["input_ids"]), list(example["labels"])
        labels[0] = IGNORE_INDEX
        if input_ids[-1] != self.eos_id:
            input_ids.append(self.eos_id)
            labels.append(IGNORE_INDEX)
        self.pending["input_ids"] += input_ids
        self.pending["labels"] += labels
        self.pending["position_ids"] += range(len(input_ids))
        rows = []
        while len(self.pending["input_ids"]) >= self.seq_len:
            rows.append({key: values[: self.seq_len] for key, values in self.pending.items()})
            self.pending = {key: values[self.seq_len :] for key, values in self.pending.items()}
        return rows

    def flush(self) -> list[dict[str, list[int]]]:
        """The waiting tokens as a last row (none when nothing waits)."""
        row = self.pending
        self.pending = {key: [] for key in row}
        return [row] if row["input_ids"] else []

    def state_dict(self) -> dict[str, list[int]]:
        return {key: list(values) for key, values in self.pending.items()}

    def load_state_dict(self, state: dict[str, list[int]]) -> None:
        self.pending = {key: list(state[key]) for key in ("input_ids", "labels", "position_ids")}
