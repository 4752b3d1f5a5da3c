"""The largest image a vision-language model's fastest fit takes (``memfit fit``): with images, the
image size is a knob like the sequence length.

The search keeps the fastest configuration it found (method, settings, micro-batch, ``seq_len``)
and climbs the ladder of square image sides the family's processor lays out differently
(:func:`memfit.models.vision.image_sides`), bisecting: memory grows with the image, so the largest
side that plans within the target is the answer. A side whose image tokens ``seq_len`` cannot hold
does not fit either (the row's length is the configuration's); the answer says which limit it met.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from memfit.planner.errors import PlanError
from memfit.planner.search.plans import SearchPlanner
from memfit.planner.search.results import Fit


def largest_image(planner: SearchPlanner, fit: Fit, config_dict: dict[str, Any]) -> dict[str, Any] | None:
    """The largest ``image_max_pixels`` on the processor's ladder that ``fit``'s configuration takes
    (``max_image`` of fit's JSON), planned with ``planner`` (its base: ``fit``'s spec); None for a
    text model."""
    vision = fit.plan.details.get("vision")
    if not vision:
        return None
    from memfit.models.build import make_config
    from memfit.models.vision import image_sides

    sides = image_sides(make_config(config_dict))
    if len(sides) == 1:  # the processor resizes every image to one size: nothing to search
        return _answer(fit.spec, vision, "processor")
    # The fit's own image size fits: the climb starts at the largest rung it covers.
    given = int(fit.spec["image_max_pixels"])
    low = max((index for index, side in enumerate(sides) if side * side <= given), default=-1)
    high, best, limit = len(sides), vision, "ladder"  # sides[high] does not fit (or is past the ladder)
    while high - low > 1:
        middle = (low + high) // 2
        found, why = _planned(planner, sides[middle])
        if found is not None:
            low, best = middle, found
        else:
            high, limit = middle, why
    return _answer(fit.spec, best, limit)


def _planned(planner: SearchPlanner, side: int) -> tuple[dict[str, Any] | None, str]:
    """The plan's ``details.vision`` at a square side of ``side`` if it fits, else None and why:
    ``memory``, or ``seq_len`` (its images' tokens do not fit the row)."""
    try:
        plan = planner(image_max_pixels=side * side)
    except PlanError:
        return None, "seq_len"
    return (plan.details["vision"], "") if plan.fits else (None, "memory")


def _answer(spec: dict[str, Any], vision: dict[str, Any], limited_by: str) -> dict[str, Any]:
    return {
        "method": spec["method"],
        "batch_size": spec["batch_size"],
        "seq_len": spec["seq_len"],
        "images": vision["images"],
        "image_max_pixels": vision["image_max_pixels"],
        "image_size": list(vision["image_size"]),
        "tokens_per_image": vision["tokens_per_image"],
        "limited_by": limited_by,
    }


def image_planner(job: Any, fit: Fit, progress: Callable[[str], None] | None) -> SearchPlanner:
    """The planner of ``fit``'s configuration, every knob its own but the image size."""
    planner = SearchPlanner(job.model, job.target, dict(fit.spec), progress, job.deepspeed, exact=job.exact)
    planner.supports_bf16 = job.supports_bf16
    return planner
