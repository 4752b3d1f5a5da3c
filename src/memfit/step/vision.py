"""A vision-language micro-batch: the images' tensors beside the tokens, as the model's forward takes them.

An example of a vision-language run holds, beside ``input_ids`` and ``labels``, what the family's
processor made of its images (:data:`IMAGE_KEYS`): ``pixel_values`` and the tensors that describe
them (Qwen's ``image_grid_thw``, Pixtral's ``image_sizes``, Llama 3.2 Vision's tiles and masks).
:class:`VisionCollate` puts a micro-batch's together, as the trainer and the planner both collate:
per-image tensors concatenated over the batch's images, per-example ones stacked a row an example,
per-token ones padded as the ids are. The planner's examples hold :class:`Pixels` in place of
pixel values (their shape: fake tensors have no values to hold); the micro-batch has the same tensors.

Qwen's multimodal rotary positions (``[3, batch, seq]``) are the model's own ``get_rope_index`` of
the ids and the image grids, computed on the host as the batch is made (a run's ids are on the
host there; a plan's are the planned ids): the forward then takes them as ``position_ids``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from memfit.models.vision import ImageLayout, image_layout, image_token_id, is_vision_config
from memfit.step.labels import IGNORE_INDEX

#: Tensors concatenated over a batch's images (their first dimension counts images or patches).
PER_IMAGE = ("pixel_values", "image_grid_thw", "image_sizes")
#: Tensors with one row an example (Idefics3's and Llama 3.2 Vision's pixel values among them).
PER_EXAMPLE = ("pixel_attention_mask", "aspect_ratio_ids", "aspect_ratio_mask")
#: Tensors with one entry a token, padded as the ids are.
PER_TOKEN = ("token_type_ids", "cross_attention_mask")
#: Every key an example may carry for its images.
IMAGE_KEYS = PER_IMAGE + PER_EXAMPLE + PER_TOKEN
#: The model types whose pixel values are stacked a row an example.
_STACKED = ("idefics3", "smolvlm", "mllama")


@dataclass(frozen=True)
class Pixels:
    """Pixel values by their shape alone: what a plan's examples hold (the micro-batch makes a
    tensor of that shape, as a run's collate makes one from the processor's values)."""

    shape: tuple[int, ...]

    def __len__(self) -> int:
        return self.shape[0]


@dataclass(frozen=True)
class VisionCollate:
    """Adds a vision-language model's image tensors to a padded micro-batch (:meth:`add`)."""

    model_type: str
    image_token_id: int
    pixel_dtype: torch.dtype = torch.float32  # the weights' format: the tower takes its pixels in it
    rope_index: Any = None  # Qwen's get_rope_index, bound to an object holding the config; None: 1-D positions

    def collate(self, examples: Sequence[dict[str, Any]], pad_token_id: int) -> dict[str, Any]:
        """The padded micro-batch of ``examples`` (as :func:`memfit.step.batch.collate` pads them)
        with their images' tensors. The ids, labels, masks and grids are tensors whose values a
        simulation keeps (:func:`memfit.step.seam.values_tensor`): the forward reads them."""
        from memfit.step.seam import values_tensor

        lengths = [len(example["input_ids"]) for example in examples]
        longest = max(lengths)
        ids = _padded_rows([example["input_ids"] for example in examples], longest, pad_token_id)
        batch: dict[str, Any] = {
            "input_ids": values_tensor(ids),
            "labels": values_tensor(_padded_rows([e["labels"] for e in examples], longest, IGNORE_INDEX)),
        }
        if min(lengths) < longest:
            mask = _padded_rows([np.ones(length, dtype=np.int64) for length in lengths], longest, 0)
            batch["attention_mask"] = values_tensor(mask)
        if not any(example.get("pixel_values") is not None for example in examples):
            return batch
        stacked = self.model_type in _STACKED
        for key in PER_IMAGE:
            parts = [example[key] for example in examples if key in example]
            if parts and key == "pixel_values":
                pixels = _stack(parts) if stacked else _concatenate(parts)
                batch[key] = pixels.to(self.pixel_dtype)
            elif parts:
                batch[key] = values_tensor(np.concatenate([np.asarray(part) for part in parts]))
        for key in PER_EXAMPLE:
            if any(key in example for example in examples):
                batch[key] = values_tensor(np.stack([np.asarray(example[key]) for example in examples]))
        for key in PER_TOKEN:
            if any(key in example for example in examples):
                batch[key] = values_tensor(_padded_rows([example[key] for example in examples], longest, 0))
        if self.rope_index is not None:
            batch["position_ids"] = values_tensor(self._positions(ids, lengths, examples))
        return batch

    def _positions(self, ids: np.ndarray, lengths: list[int], examples: Sequence[dict[str, Any]]) -> np.ndarray:
        """Qwen's ``[3, batch, seq]`` positions: the model's ``get_rope_index`` of the host's ids."""
        from memfit.step.seam import on_host_values

        grids = np.concatenate([np.asarray(example["image_grid_thw"]).reshape(-1, 3) for example in examples])

        def positions() -> np.ndarray:
            host_ids = torch.from_numpy(ids)
            token_types = (host_ids == self.image_token_id).to(torch.int32)
            mask = None
            if min(lengths) < ids.shape[1]:
                mask = torch.from_numpy(_padded_rows([np.ones(n, dtype=np.int64) for n in lengths], ids.shape[1], 0))
            found, _ = self.rope_index(
                host_ids, image_grid_thw=torch.from_numpy(grids), attention_mask=mask, mm_token_type_ids=token_types
            )
            return found.numpy()

        return on_host_values(positions)


def vision_collate(config, weight_precision: str = "fp32") -> VisionCollate | None:
    """The :class:`VisionCollate` of a vision-language model's config (a transformers config) whose
    weights are in ``weight_precision`` (``bf16``...), or None for a text model."""
    if not is_vision_config(config):
        return None
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(weight_precision, torch.float32)
    return VisionCollate(config.model_type, image_token_id(config), dtype, _rope_index(config))


def _rope_index(config):
    """The model's own ``get_rope_index``, bound to an object that holds only ``config`` (it reads
    nothing else of the model), for models with multimodal rotary positions; else None."""
    from transformers.models.auto.modeling_auto import MODEL_MAPPING

    model_class = MODEL_MAPPING.get(type(config), None)
    if model_class is None or not hasattr(model_class, "get_rope_index"):
        return None
    holder = object.__new__(model_class)
    holder.__dict__["config"] = config
    return holder.get_rope_index


def _pixel_tensor(value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    return torch.from_numpy(np.ascontiguousarray(value))


def _concatenate(parts: list[Any]) -> torch.Tensor:
    """Pixel values concatenated over the images (a plan's by shape: one tensor of their shape)."""
    if all(isinstance(part, Pixels) for part in parts):
        return torch.zeros((sum(p.shape[0] for p in parts), *parts[0].shape[1:]), dtype=torch.float32)
    return torch.cat([_pixel_tensor(part) for part in parts])


def _stack(parts: list[Any]) -> torch.Tensor:
    """Pixel values a row an example."""
    if all(isinstance(part, Pixels) for part in parts):
        return torch.zeros((len(parts), *parts[0].shape), dtype=torch.float32)
    return torch.stack([_pixel_tensor(part) for part in parts])


def _padded_rows(rows: list[Any], longest: int, fill: int) -> np.ndarray:
    """Rows of per-token values padded with ``fill`` to ``longest`` tokens."""
    arrays = [np.asarray(row) for row in rows]
    out = np.full((len(arrays), longest, *arrays[0].shape[1:]), fill, dtype=arrays[0].dtype)
    for index, row in enumerate(arrays):
        out[index, : len(row)] = row
    return out


# ------------------------------------------------------------------------------------------------
# The planned examples: the longest the run takes, with its images at their largest


def planned_vision_example(config, length: int, images: int, max_pixels: int) -> dict[str, Any]:
    """An example of ``length`` tokens holding ``images`` images of the largest size the run takes
    (``max_pixels``), laid out as the family's processor lays them out: each image's placeholder
    tokens after a first text token, their labels -100 (no loss is taken on an image), and the
    image tensors by shape."""
    layout = image_layout(config, max_pixels)
    token = image_token_id(config)
    ids = np.zeros(length, dtype=np.int64)
    start = 1
    for _ in range(images):
        ids[start : start + layout.tokens] = token
        start += layout.sequence_tokens
    labels = np.where(ids == token, IGNORE_INDEX, ids)
    example: dict[str, Any] = {"input_ids": ids, "labels": labels}
    example.update(_image_tensors(config, layout, images, ids == token))
    return example


def _image_tensors(config, layout: ImageLayout, images: int, is_image: np.ndarray) -> dict[str, Any]:
    """The image keys of one example of ``images`` images of ``layout``."""
    family = layout.family
    if family in ("idefics3", "smolvlm"):
        tiles, *rest = layout.pixel_shape
        size = rest[-1]
        return {
            "pixel_values": Pixels((images * tiles, *rest)),
            "pixel_attention_mask": np.ones((images * tiles, size, size), dtype=bool),
        }
    if family == "mllama":
        tiles = layout.extras["tiles"]
        cross = np.zeros((len(is_image), images, tiles), dtype=np.int64)
        first = int(np.argmax(is_image)) if is_image.any() else 0
        cross[first:] = 1  # every token after the first image attends to every image's tiles
        return {
            "pixel_values": Pixels((images, *layout.pixel_shape)),
            "aspect_ratio_ids": np.full(images, layout.extras["aspect_ratio_id"], dtype=np.int64),
            "aspect_ratio_mask": np.ones((images, tiles), dtype=np.int64),
            "cross_attention_mask": cross,
        }
    first = layout.pixel_shape[0]
    shape = (images * first, *layout.pixel_shape[1:]) if family.startswith("qwen") or family == "llama4" else None
    example: dict[str, Any] = {"pixel_values": Pixels(shape or (images, *layout.pixel_shape))}
    if "image_grid_thw" in layout.extras:
        example["image_grid_thw"] = np.array([layout.extras["image_grid_thw"]] * images, dtype=np.int64)
    if "image_sizes" in layout.extras:
        example["image_sizes"] = np.array([layout.extras["image_sizes"]] * images, dtype=np.int64)
    if family == "gemma3":
        example["token_type_ids"] = is_image.astype(np.int64)
    return example
