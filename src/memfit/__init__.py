"""memfit: fine-tune LLMs on the GPU you have.

Plan the peak GPU memory of a fine-tuning run before it starts (``memfit.plan``), find the
configurations that fit a GPU (``memfit.fit``), merge adapters shard by shard (``memfit.merge``). Heavy dependencies (torch, transformers, peft) are imported only
when a function that needs them is called, so ``import memfit`` is cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["plan", "fit", "merge", "watch", "__version__"]

if TYPE_CHECKING:  # pragma: no cover
    from memfit.planner.report import MemoryPlan
    from memfit.planner.search.results import FitResult


def plan(model: str, **knobs: Any) -> MemoryPlan:
    """Plan the peak GPU memory of one training step. See :func:`memfit.planner.api.plan`."""
    from memfit.planner.api import plan as _plan

    return _plan(model, **knobs)


def fit(model: str | dict, **options: Any) -> FitResult:
    """Find the configurations of ``model`` that fit a GPU or a budget, fastest first (``memfit fit``).

    ``options``: the fields of :class:`~memfit.planner.search.request.FitRequest` (``gpu``,
    ``budget``, ``batch_size``, ``seq_len``, ``methods``...), the callbacks of
    :class:`~memfit.planner.search.request.FitEvents` (``progress``, ``found``...), and any other
    name a RunSpec knob every plan holds (``rank=32``). See :func:`memfit.planner.search.driver.fit`.
    """
    from memfit.planner.search.driver import fit as _fit
    from memfit.planner.search.request import keyword_request

    return _fit(*keyword_request(model, **options))


def merge(base: str, adapter: str, out: str, **options: Any):
    """Merge a LoRA adapter into its base checkpoint shard by shard. See :func:`memfit.merge.merge`."""
    from memfit.merge import merge as _merge

    return _merge(base, adapter, out, **options)


def __getattr__(name: str):
    # ``memfit.watch.MemoryCallback(...)`` works after a plain ``import memfit``.
    if name == "watch":
        import importlib

        return importlib.import_module("memfit.watch")
    raise AttributeError(f"module 'memfit' has no attribute {name!r}")
