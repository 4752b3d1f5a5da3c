"""Vision-language records tokenized by the model's processor: ids, labels and the images' tensors.

A record in TRL's vision format (:mod:`memfit.train.data.vision_records`) is rendered with the
processor's chat template, as text records are with the tokenizer's; the processor then puts each
image's placeholder tokens in the text and makes the image's tensors (``pixel_values``, Qwen's
``image_grid_thw``...). Labels are taken on the assistant turns as for text: the rendered text is
tokenized with its character offsets and masked outside the assistant turns, then matched token by
token to the processor's ids; the tokens the processor put in (an image's placeholders, its
markers) are never trained. An image keeps at most ``image_max_pixels`` pixels (resized down, its
sides in proportion, before the processor sees it: the largest image a plan plans).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from memfit.step.labels import IGNORE_INDEX
from memfit.train.data.chat import ChatTemplateError, render_chat
from memfit.train.data.errors import DataError, Problems
from memfit.train.data.tokenization import mask_outside_spans

#: The processor's outputs that are tensors of the images (step/vision.py collates them).
_PER_IMAGE = ("pixel_values", "image_grid_thw", "image_sizes")
_PER_EXAMPLE = ("pixel_attention_mask", "aspect_ratio_ids", "aspect_ratio_mask")
_PER_TOKEN = ("token_type_ids", "cross_attention_mask")
#: The model types whose processor stacks pixel values a row an example.
_STACKED = ("idefics3", "smolvlm", "mllama")


def tokenize_vision_records(
    records: Sequence[dict[str, Any]],
    processor: Any,
    *,
    seq_len: int,
    max_images: int,
    max_pixels: int,
    model_type: str,
    train_on_inputs: bool = False,
) -> list[dict[str, Any]]:
    """The records as training examples: ``input_ids`` and ``labels`` (lists) and the image keys the
    model's forward takes. Every problem (an image that cannot be read, more images than
    ``max_images``, image tokens past ``seq_len``) is raised at once as one :class:`DataError`
    naming each record; a record left with no trained token is dropped."""
    problems = Problems()
    examples = []
    for record in records:
        try:
            example = tokenize_vision_record(
                record,
                processor,
                seq_len=seq_len,
                max_images=max_images,
                max_pixels=max_pixels,
                model_type=model_type,
                train_on_inputs=train_on_inputs,
            )
        except (ChatTemplateError, ValueError) as exc:
            problems.add(record.get("source", "record"), str(exc))
            continue
        if example is not None:
            examples.append(example)
    problems.raise_if_any("the records")
    if not examples:
        raise DataError(
            f"no example has a trained token within seq_len={seq_len} ({len(records)} records); "
            "raise seq_len or check that the conversations have assistant turns"
        )
    return examples


def tokenize_vision_record(
    record: dict[str, Any],
    processor: Any,
    *,
    seq_len: int,
    max_images: int,
    max_pixels: int,
    model_type: str,
    train_on_inputs: bool = False,
) -> dict[str, Any] | None:
    """One record as an example (see :func:`tokenize_vision_records`), or None when no token of it is
    trained within ``seq_len``. Raises ValueError naming the problem and its fix."""
    if "messages" not in record:
        raise ValueError("a vision-language model trains on conversations (messages, TRL's vision format)")
    references = record.get("images") or []
    if len(references) > max_images:
        raise ValueError(
            f"images: {len(references)} images, more than images: {max_images} the run plans for an example; "
            f"set images: {len(references)}"
        )
    pictures = [open_image(reference, index, max_pixels) for index, reference in enumerate(references)]
    text, spans = render_chat(
        processor, record["messages"], find_assistant_spans=not train_on_inputs, from_turn=record.get("train_from", 0)
    )
    encoding = processor.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(encoding["input_ids"])
    labels = list(ids) if train_on_inputs else mask_outside_spans(ids, encoding["offset_mapping"], spans)
    out = processor(text=[text], images=pictures or None, add_special_tokens=False, return_tensors="np")
    image_id = image_token_id(processor)
    full_ids = [int(i) for i in out["input_ids"][0]]
    full_labels = aligned_labels(ids, labels, full_ids, image_id)
    image_positions = [index for index, token in enumerate(full_ids) if token == image_id]
    if image_positions and image_positions[-1] >= seq_len:
        raise ValueError(
            f"seq_len: {seq_len} cuts its image tokens ({len(image_positions)} of them, the last at token "
            f"{image_positions[-1] + 1}); raise seq_len to {len(full_ids)}, or lower image_max_pixels or images"
        )
    if all(label == IGNORE_INDEX for label in full_labels[1:seq_len]):
        return None
    example: dict[str, Any] = {"input_ids": full_ids[:seq_len], "labels": full_labels[:seq_len]}
    stacked = model_type in _STACKED
    for key in _PER_IMAGE:
        if key in out and pictures:
            example[key] = np.asarray(out[key][0] if stacked and key == "pixel_values" else out[key])
    for key in _PER_EXAMPLE:
        if key in out and pictures:
            example[key] = np.asarray(out[key][0])
    for key in _PER_TOKEN:
        if key in out:
            example[key] = np.asarray(out[key][0])[:seq_len]
    return example


def image_token_id(processor: Any) -> int:
    """The id of the processor's image placeholder token."""
    found = getattr(processor, "image_token_id", None)
    if found is None:
        found = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    return int(found)


def aligned_labels(ids: list[int], labels: list[int], full_ids: list[int], image_id: int) -> list[int]:
    """``labels`` (of ``ids``, the rendered text's tokens) for ``full_ids``, the processor's tokens of
    the same text with the images' placeholders put in: each token of ``ids`` keeps its label where
    it is found again, in order; what the processor put in, and every image token, takes none."""
    out, position = [], 0
    for token in full_ids:
        if position < len(ids) and token == ids[position]:
            out.append(labels[position] if token != image_id else IGNORE_INDEX)
            position += 1
        else:
            out.append(IGNORE_INDEX)
    if position < len(ids):
        raise ValueError(
            "the processor's tokens are not the rendered text's with the images put in; check that the processor "
            "and the tokenizer belong to the model"
        )
    return out


def open_image(reference: Any, index: int, max_pixels: int):
    """The ``index``-th image of a record as an RGB picture of at most ``max_pixels`` pixels (its sides
    scaled down in proportion). Raises ValueError naming the image and the fix."""
    from PIL import Image, UnidentifiedImageError

    path = reference.get("path") if isinstance(reference, dict) else reference
    try:
        if isinstance(reference, dict) and reference.get("bytes") is not None:
            import io

            picture = Image.open(io.BytesIO(reference["bytes"]))
        elif isinstance(reference, str) or isinstance(reference, dict):
            picture = Image.open(path)
        else:
            picture = reference
        picture = picture.convert("RGB")
    except FileNotFoundError:
        raise ValueError(f"images[{index}]: no file {path}; give the image's path relative to the data file") from None
    except (UnidentifiedImageError, OSError) as err:
        raise ValueError(f"images[{index}]: cannot read {path} as an image ({err}); replace the file") from None
    width, height = picture.size
    if width * height > max_pixels:
        scale = math.sqrt(max_pixels / (width * height))
        picture = picture.resize((max(1, int(width * scale)), max(1, int(height * scale))))
    return picture
