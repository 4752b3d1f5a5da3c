"""TRL's vision format: a conversation whose turns hold parts, and the record's images beside it.

A record of a vision-language run is a ``messages`` conversation whose turns' ``content`` may be a
list of parts, ``{"type": "image"}`` where an image goes and ``{"type": "text", "text": ...}``,
and an ``images`` column holding one image per image part, in order: a file path (relative to the
data file), or a ``datasets`` Image feature (a decoded picture, or ``{"bytes", "path"}``).
Validation here reads no image; :mod:`memfit.train.data.vision` opens them as it tokenizes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from memfit.train.data.errors import Problems
from memfit.train.data.readers import RawRecord, json_type_name

#: The part types a turn's content list may hold.
PART_TYPES = ("image", "text")


def check_content_parts(parts: list, raw: RawRecord, field: str, problems: Problems) -> str | list | None:
    """A turn's content given as a list of parts: the parts (each ``{"type": "image"}`` or
    ``{"type": "text", "text": str}``) when one is an image, their text joined when none is (a text
    turn as any template renders it); None with the problems added."""
    before = problems.count
    kept: list[dict[str, Any]] = []
    for index, part in enumerate(parts):
        where = f"{field}[{index}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in PART_TYPES:
            found = json_type_name(part) if not isinstance(part, dict) else f"type {kind!r}"
            problems.add(raw.where, f"expected a part of type image or text, got {found}", where)
        elif kind == "text" and not isinstance(part.get("text"), str):
            problems.add(raw.where, f"expected a string, got {json_type_name(part.get('text'))}", f"{where}.text")
        else:
            kept.append({"type": "image"} if kind == "image" else {"type": "text", "text": part["text"]})
    if problems.count > before:
        return None
    if not kept:
        problems.add(raw.where, "empty list of parts", field)
        return None
    if not any(part["type"] == "image" for part in kept):
        return "".join(part["text"] for part in kept)
    return kept


def image_parts(messages: list[dict[str, Any]]) -> int:
    """How many image parts ``messages`` hold."""
    return sum(
        1
        for message in messages
        if isinstance(message.get("content"), list)
        for part in message["content"]
        if part.get("type") == "image"
    )


def check_images(
    images: Any, messages: list[dict[str, Any]], raw: RawRecord, problems: Problems, list_key: str
) -> list | None:
    """The record's ``images``, one for each image part of its ``messages`` (an empty list for a text
    conversation without them); None with the problem added."""
    wanted = image_parts(messages)
    given = [] if images is None else images
    if not isinstance(given, list):
        problems.add(raw.where, f"expected a list of images (file paths), got {json_type_name(images)}", "images")
        return None
    for index, image in enumerate(given):
        if not _is_image_reference(image):
            problems.add(
                raw.where,
                f"expected a file path or an image, got {json_type_name(image)}; give the image's path, relative "
                "to the data file",
                f"images[{index}]",
            )
            return None
    if len(given) != wanted:
        problems.add(
            raw.where,
            f"{len(given)} image(s) but {wanted} image part(s) ({{'type': 'image'}}) in {list_key}; give one image "
            "for each image part, in order",
            "images",
        )
        return None
    return given


def _is_image_reference(image: Any) -> bool:
    """A path, a ``datasets`` Image feature's ``{"bytes", "path"}``, or a decoded picture."""
    if isinstance(image, str):
        return bool(image.strip())
    if isinstance(image, dict):
        return image.get("bytes") is not None or isinstance(image.get("path"), str)
    return hasattr(image, "convert") and hasattr(image, "size")  # a PIL image


def resolve_image_paths(records: list[dict[str, Any]], folder: Path) -> list[dict[str, Any]]:
    """``records`` with their relative image paths made relative to ``folder`` (the data file's)."""
    for record in records:
        if "images" in record:
            record["images"] = [_resolved(image, folder) for image in record["images"]]
    return records


def _resolved(image: Any, folder: Path) -> Any:
    if isinstance(image, str) and not Path(image).is_absolute():
        return str(folder / image)
    if isinstance(image, dict) and image.get("bytes") is None and isinstance(image.get("path"), str):
        path = image["path"]
        return path if Path(path).is_absolute() else str(folder / path)
    return image
