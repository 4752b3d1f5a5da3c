"""The words around a plan's figures, as ``memfit plan`` prints them, for the page (``POST /api/explain``).

The plan's JSON holds its figures and facts; the command line's report adds words to them (its
first line, what each category holds, the attention and reference lines, the memory-lean
techniques, what to change when it does not fit). The page shows the same words, made by the same
functions (:mod:`memfit.planner.report`), so that a plan reads the same on the page and in a terminal.
"""

from __future__ import annotations

from typing import Any


def explain(plan: dict[str, Any]) -> dict[str, Any]:
    """For ``plan`` (``memfit plan --json``): ``headline`` (its first line), ``precision`` (what its
    precision keeps in which format), ``category_help`` (what each category holds in this plan),
    ``lines`` (the facts under the figures: attention, a preference objective's reference model,
    the memory-lean step), ``features`` (the memory-lean techniques alone) and ``suggestions`` (the
    knob changes that lower it, when it does not fit). Raises KeyError or TypeError for a dict
    that is not a plan."""
    from rich.text import Text

    from memfit.planner.report import CATEGORY_HELP, fact_lines, plan_headline, step_features, suggestions
    from memfit.spec import precision_regime_of

    spec, details = plan.get("spec") or {}, plan.get("details") or {}
    return {
        "headline": Text.from_markup(plan_headline(str(plan.get("model", "")), spec, details)).plain,
        "precision": precision_regime_of(spec),
        "category_help": {**CATEGORY_HELP, **details.get("category_help", {})},
        "lines": fact_lines(spec, details),
        "features": step_features(spec, details),
        "suggestions": suggestions(spec) if plan.get("fits") is False else [],
    }
