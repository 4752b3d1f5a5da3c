"""What a plan says of a vision-language model: its images, their tokens, the tower and the projector."""

from __future__ import annotations

from typing import Any

from memfit.models.vision import image_layout, is_vision_config, vision_parts


def vision_details(
    config_dict: dict[str, Any], images: int, max_pixels: int, weight_bytes: int
) -> dict[str, Any] | None:
    """What a plan says of a vision-language model (``details.vision``), or None for a text model:
    the images and their tokens, the tower's blocks, and the tower's and projector's parameters
    (built on ``meta``) and their bytes at ``weight_bytes`` a parameter."""
    if not is_vision_config(config_dict):
        return None
    import torch
    from torch import nn

    from memfit.models.build import build_meta_model, make_config

    config = make_config(config_dict)
    layout = image_layout(config, max_pixels)
    parts = vision_parts(build_meta_model(config, torch.bfloat16))
    counts = {kind: sum(p.numel() for p in module.parameters()) for kind, module in parts.items()}
    if "projector" in parts and "tower" in parts and any(m is parts["projector"] for m in parts["tower"].modules()):
        counts["tower"] -= counts["projector"]  # Qwen's merger is inside the tower: counted once, as the projector
    blocks = max((len(m) for m in parts["tower"].modules() if isinstance(m, nn.ModuleList)), default=0)
    return {
        "images": images,
        "image_max_pixels": max_pixels,
        "image_size": [layout.height, layout.width],
        "tokens_per_image": layout.tokens,
        "sequence_tokens_per_image": layout.sequence_tokens,
        "tower_blocks": blocks,
        "tower_params": counts.get("tower", 0),
        "projector_params": counts.get("projector", 0),
        "tower_weight_bytes": (counts.get("tower", 0) + counts.get("projector", 0)) * weight_bytes,
    }
