"""Vision-language models: where their parts are, and what an image costs in tokens and pixels.

A vision-language config holds its language model under ``text_config`` and its vision tower under
``vision_config``; transformers builds the whole model (``AutoModelForImageTextToText``): the
language model, the vision tower and the projector that maps the tower's features into the
language model's embeddings. Its decoder layers are the language model's (a vision tower's blocks
are another list, which may be the longer one: Qwen2.5-VL's 32 against 28).

What an image becomes is each family's processor's rule, computed here from the config's and the
image processor's parameters (:class:`ImageLayout`): the image tokens it takes in the sequence and
the ``pixel_values`` (and the other tensors) the model's forward receives. The largest image the
run takes (``image_max_pixels``) is the one a plan plans.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # (torch is imported where a model is looked into: a config's questions need none)
    from torch import nn

#: The attributes a vision-language model keeps its vision tower and projector under.
TOWER_NAMES = ("visual", "vision_tower", "vision_model")
PROJECTOR_NAMES = ("multi_modal_projector", "connector")

#: The default of ``image_max_pixels``: LLaMA-Factory's (768 x 768).
DEFAULT_IMAGE_MAX_PIXELS = 768 * 768


def is_vision_config(config: dict[str, Any] | Any) -> bool:
    """Whether ``config`` (a dict or a transformers config) is a vision-language model's: a
    ``vision_config`` beside its language model's ``text_config`` (a published config.json may keep
    its language model's fields at the top, as Qwen2.5-VL's does: a family memfit plans)."""
    get = config.get if isinstance(config, dict) else lambda name: getattr(config, name, None)
    if get("vision_config") is None:
        return False
    return get("text_config") is not None or get("model_type") in _LAYOUTS


def nested_config(config_dict: dict[str, Any]) -> dict[str, Any]:
    """A vision-language config dict with its language model under ``text_config``, as transformers
    nests it (a published config.json with the language model's fields at the top, Qwen2.5-VL's,
    made so by transformers' own config class); any other dict as it is."""
    if not is_vision_config(config_dict) or isinstance(config_dict.get("text_config"), dict):
        return config_dict
    from transformers import AutoConfig

    data = dict(config_dict)
    config = AutoConfig.for_model(data.pop("model_type"), **data)
    return {**config.to_dict(), "model_type": config.model_type}


def language_config(config):
    """The transformers config of ``config``'s language model: its ``text_config``, or itself."""
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def language_model(model: nn.Module) -> nn.Module:
    """The language model of a vision-language ``model`` (PEFT's wrapper seen through), or ``model``
    itself for a text model: the module whose layers are the decoder's."""
    from torch import nn

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not is_vision_config(getattr(base, "config", None)):
        return model
    inner = getattr(base, "model", base)
    for name in ("language_model", "text_model"):
        found = getattr(inner, name, None) or getattr(base, name, None)
        if isinstance(found, nn.Module):
            return found
    return base.get_decoder()


def vision_parts(model: nn.Module) -> dict[str, nn.Module]:
    """The vision tower and the projector of a vision-language ``model`` by their short names
    (``{"tower": ..., "projector": ...}``; Qwen's projector is the tower's ``merger``); empty for a
    text model."""
    from torch import nn

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not is_vision_config(getattr(base, "config", None)):
        return {}
    inner = getattr(base, "model", base)
    parts: dict[str, nn.Module] = {}
    for owner in (inner, base):
        for name in TOWER_NAMES:
            if "tower" not in parts and isinstance(getattr(owner, name, None), nn.Module):
                parts["tower"] = getattr(owner, name)
        for name in PROJECTOR_NAMES:
            if "projector" not in parts and isinstance(getattr(owner, name, None), nn.Module):
                parts["projector"] = getattr(owner, name)
    merger = getattr(parts.get("tower"), "merger", None)
    if "projector" not in parts and isinstance(merger, nn.Module):
        parts["projector"] = merger
    return parts


def vision_module_names(model: nn.Module) -> dict[str, str]:
    """Qualified module name -> ``"tower"`` or ``"projector"`` for the vision parts' own modules
    (a projector inside the tower, Qwen's merger, counts as the projector)."""
    parts = vision_parts(model)
    ids = {id(m): kind for kind in ("tower", "projector") if kind in parts for m in parts[kind].modules()}
    return {name: ids[id(m)] for name, m in model.named_modules() if id(m) in ids}


# ------------------------------------------------------------------------------------------------
# What an image is to each family's processor


@dataclass(frozen=True)
class ImageLayout:
    """One image as the model takes it: ``tokens`` placeholder tokens in the sequence (around them,
    ``wrapper_tokens`` text tokens the processor adds: start and end markers, row breaks), and the
    tensors of its forward, each by its shape for one image (``per_image``: concatenated along the
    first dimension over a batch's images; ``per_example``: one row per example, the images of an
    example along the second dimension)."""

    family: str
    tokens: int
    pixel_shape: tuple[int, ...]
    wrapper_tokens: int = 0
    height: int = 0
    width: int = 0
    extras: dict[str, Any] = field(default_factory=dict)
    stacked: bool = False  # pixel_values [batch, images, ...] (one row per example) rather than [images, ...]

    @property
    def sequence_tokens(self) -> int:
        """Tokens one image takes in an example: its placeholders and the markers around them."""
        return self.tokens + self.wrapper_tokens


def _qwen(config, max_pixels: int, family: str) -> ImageLayout:
    vision = config.vision_config
    patch, merge = int(vision.patch_size), int(vision.spatial_merge_size)
    temporal = int(getattr(vision, "temporal_patch_size", 2))
    channels = int(getattr(vision, "in_channels", getattr(vision, "in_chans", 3)))
    factor = patch * merge
    # The processor's smart_resize: sides multiples of patch x merge, the area under max_pixels.
    side = max(factor, math.floor(math.sqrt(max_pixels) / factor) * factor)
    grid = side // patch
    return ImageLayout(
        family,
        tokens=grid * grid // (merge * merge),
        pixel_shape=(grid * grid, channels * temporal * patch * patch),
        wrapper_tokens=2,  # <|vision_start|> ... <|vision_end|>
        height=side,
        width=side,
        extras={"image_grid_thw": (1, grid, grid)},
    )


def _fixed_square(config, max_pixels: int, family: str) -> ImageLayout:
    """Gemma 3 and LLaVA: every image resized to the tower's square; a fixed number of tokens."""
    vision = config.vision_config
    size, patch = int(vision.image_size), int(vision.patch_size)
    if family == "gemma3":
        tokens, wrapper = int(config.mm_tokens_per_image), 2  # <start_of_image> ... <end_of_image>
    else:
        tokens = (size // patch) ** 2 + (1 if getattr(config, "vision_feature_select_strategy", "") == "full" else 0)
        wrapper = 0
    return ImageLayout(
        family, tokens=tokens, pixel_shape=(3, size, size), wrapper_tokens=wrapper, height=size, width=size
    )


def _pixtral(config, max_pixels: int, family: str) -> ImageLayout:
    """Mistral 3 (Pixtral's tower): the image resized under the tower's longest edge and
    ``max_pixels`` to multiples of the patch; a token per merged patch, a break after each row."""
    vision = config.vision_config
    patch, merge = int(vision.patch_size), int(getattr(config, "spatial_merge_size", 1))
    factor = patch * merge
    side = min(int(vision.image_size), math.isqrt(max_pixels))
    side = max(factor, side // factor * factor)
    rows = cols = side // factor
    return ImageLayout(
        family,
        tokens=rows * cols,
        pixel_shape=(3, side, side),
        wrapper_tokens=rows,  # [IMG_BREAK] after each row, [IMG_END] after the last
        height=side,
        width=side,
        extras={"image_sizes": (side, side)},
    )


def _idefics3(config, max_pixels: int, family: str) -> ImageLayout:
    """Idefics3 and SmolVLM: the image split into tiles of the tower's size, plus the whole image
    resized to one tile; each tile ``(size / patch)^2 / scale_factor^2`` tokens."""
    vision = config.vision_config
    size, patch, scale = int(vision.image_size), int(vision.patch_size), int(config.scale_factor)
    # The processor's longest edge is 4 tiles; max_pixels bounds the side further.
    side = max(size, min(4 * size, math.isqrt(max_pixels)))
    grid = math.ceil(side / size)
    tiles = grid * grid + (1 if grid > 1 else 0)
    per_tile = (size // patch) ** 2 // (scale * scale)
    return ImageLayout(
        family,
        tokens=tiles * per_tile,
        pixel_shape=(tiles, 3, size, size),
        wrapper_tokens=3 * tiles + grid,  # <fake_token_around_image><row_i_col_j> per tile, a newline per row
        height=side,
        width=side,
        stacked=True,
    )


def _mllama(config, max_pixels: int, family: str) -> ImageLayout:
    """Llama 3.2 Vision: one ``<|image|>`` token an image; the tower sees up to ``max_num_tiles``
    tiles (the processor pads every image to that many), the language model cross-attends to them."""
    vision = config.vision_config
    size, tiles = int(vision.image_size), int(vision.max_num_tiles)
    return ImageLayout(
        family,
        tokens=1,
        pixel_shape=(tiles, 3, size, size),
        height=size,
        width=size * tiles,
        extras={"aspect_ratio_id": len(vision.supported_aspect_ratios), "tiles": tiles},
        stacked=True,
    )


def _llama4(config, max_pixels: int, family: str) -> ImageLayout:
    """Llama 4: the image cut into tiles of the tower's size (at most 16, the processor's
    ``max_patches``, and no more than ``max_pixels`` covers), plus a global tile when there are
    several; each tile ``(size / patch)^2 x pixel_shuffle_ratio^2`` tokens."""
    vision = config.vision_config
    size, patch = int(vision.image_size), int(vision.patch_size)
    tiles = max(1, min(16, max_pixels // (size * size)))
    total = tiles + (1 if tiles > 1 else 0)
    per_tile = int((size // patch) ** 2 * float(vision.pixel_shuffle_ratio) ** 2)
    return ImageLayout(
        family,
        tokens=total * per_tile,
        pixel_shape=(total, 3, size, size),
        wrapper_tokens=2 + total,  # <|image_start|>, a separator per tile, <|image_end|>
        height=size,
        width=size * tiles,
    )


#: Each family's rule, by the config's model_type.
_LAYOUTS: dict[str, Callable[[Any, int, str], ImageLayout]] = {
    "qwen2_vl": _qwen,
    "qwen2_5_vl": _qwen,
    "qwen3_vl": _qwen,
    "qwen3_vl_moe": _qwen,
    "gemma3": _fixed_square,
    "llava": _fixed_square,
    "mistral3": _pixtral,
    "idefics3": _idefics3,
    "smolvlm": _idefics3,
    "mllama": _mllama,
    "llama4": _llama4,
}


def supported_families() -> tuple[str, ...]:
    """The vision-language model types whose images memfit lays out."""
    return tuple(_LAYOUTS)


def image_layout(config, max_pixels: int = DEFAULT_IMAGE_MAX_PIXELS) -> ImageLayout:
    """The largest image ``config``'s model takes under ``max_pixels`` (a transformers config).

    Raises ValueError for a vision-language family whose processor rules memfit does not know."""
    rule = _LAYOUTS.get(config.model_type)
    if rule is None:
        raise ValueError(
            f"model_type {config.model_type!r}: memfit does not know its processor's image rules "
            f"(it plans {', '.join(sorted(_LAYOUTS))})"
        )
    return rule(config, int(max_pixels), config.model_type)


#: The largest square side (pixels) ``memfit fit`` tries for an image.
MAX_IMAGE_SIDE = 4096


def image_sides(config, max_side: int = MAX_IMAGE_SIDE) -> list[int]:
    """The square sides (pixels, at most ``max_side``) at which ``config``'s processor lays an image
    out differently, each the smallest side of its layout, smallest first: the ladder ``memfit fit``
    climbs (a side ``s`` is ``image_max_pixels`` ``s * s``). Sides are multiples of the tower's patch;
    a family whose processor resizes every image to one size has one rung."""
    step = int(config.vision_config.patch_size)
    by_layout: dict[tuple, int] = {}
    for side in range(step, max_side + 1, step):
        layout = image_layout(config, side * side)
        by_layout.setdefault((layout.tokens, layout.pixel_shape), side)
    return sorted(by_layout.values())


def image_token_id(config) -> int:
    """The id of the placeholder token an image's features replace."""
    for name in ("image_token_id", "image_token_index"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    raise ValueError(f"{config.model_type} config has no image_token_id")
