"""Everything the planner remembers between plans, in one object with one :meth:`Memo.clear`.

A search plans the same model many times, and ``memfit ui`` plans for as long as it runs; what one
plan worked out, the next is handed instead of working it out again. Each store is keyed by
everything its value depends on, so what it hands back is what working it out would give:

- ``samples``: the simulated step of one depth, by config, spec, cut, workspaces and architecture
  (:func:`memfit.planner.shortcuts.extrapolate.sample_step`);
- ``series``: live bytes by category after every event of a simulated step, by the step's result
  (:mod:`memfit.planner.shortcuts.extrapolate`, for one rank's peak);
- ``generations``: grpo's generation of one depth at the planned completion length, by config,
  spec, cut, workspaces and architecture (:mod:`memfit.planner.shortcuts.generation`);
- ``full_depths``: the reserved bytes and phase peaks of the full depth's events, by the depth plan
  and the samples' results (:func:`memfit.planner.shortcuts.extrapolate._full_depth`);
- ``streams``: the same, by the full depth's events themselves (a search's exact prediction of a
  length and its plan of it make the same events from samples of their own); a few, as they are large;
- ``depth_plans``: the cuts a config is simulated at (:func:`memfit.planner.shortcuts.depths.plan_depths`);
- ``expert_free``: the configs whose model has no experts (:func:`memfit.planner.experts.expert_details`);
- ``layouts``: a model's parameter layout (:func:`memfit.planner.layout.param_layout`);
- ``templates``: the replay templates of the last few kinds of plan
  (:class:`memfit.planner.shortcuts.replay.Replay`), by config, spec but for its shapes, and
  architecture: the same module on the same shapes does the same at every depth and length;
- on disk, the plan cache (:mod:`memfit.planner.shortcuts.cache`), kept across processes, and the
  digest of the environment its keys hold.

An exact plan (:mod:`memfit.planner.shortcuts.switch`) neither reads nor writes any of them.
"""

from __future__ import annotations

import json
from collections.abc import Hashable
from typing import Any

#: Entries each store keeps at most (the oldest goes first); templates: the kinds of plan kept.
LIMITS = {
    "samples": 128,
    "series": 128,
    "full_depths": 32,
    "streams": 4,
    "generations": 64,
    "depth_plans": 64,
    "expert_free": 64,
    "layouts": 256,
    "templates": 4,
}
#: Knobs that change the shapes a step runs on, not what it runs: templates are kept by the rest.
SHAPE_KNOBS = {"seq_len", "batch_size", "grad_accum"}


def config_key(config: dict[str, Any]) -> str:
    """A model config as the stores key it: its JSON, keys sorted (equal configs, one key)."""
    return json.dumps(config, sort_keys=True, default=str)


class Memo:
    """The planner's stores (see the module docstring), each a dict bounded by :data:`LIMITS`."""

    def __init__(self) -> None:
        self.samples: dict[Hashable, Any] = {}
        self.series: dict[Hashable, Any] = {}
        self.full_depths: dict[Hashable, Any] = {}
        self.streams: dict[Hashable, Any] = {}
        self.generations: dict[Hashable, Any] = {}
        self.depth_plans: dict[Hashable, Any] = {}
        self.expert_free: dict[Hashable, Any] = {}
        self.layouts: dict[Hashable, Any] = {}
        self.templates: dict[Hashable, dict] = {}

    def keep(self, store: str, key: Hashable, value: Any) -> Any:
        """Keep ``value`` under ``key`` in ``store`` (the oldest entry goes when it is full); returns ``value``."""
        kept = getattr(self, store)
        kept.pop(key, None)
        while len(kept) >= LIMITS[store]:
            del kept[next(iter(kept))]
        kept[key] = value
        return value

    def templates_for(self, config_dict: dict[str, Any], spec, arch: str | None) -> dict:
        """The replay templates the simulations of one kind of plan share (their depths, lengths and
        micro-batches), most recently used last."""
        scope = (
            config_key(config_dict),
            json.dumps(spec.model_dump(mode="json", exclude=SHAPE_KNOBS), sort_keys=True),
            arch,
        )
        templates = self.templates.pop(scope, None)
        return self.keep("templates", scope, {} if templates is None else templates)

    def clear(self) -> int:
        """Forget everything: every store in this process, the plan cache on disk and the environment
        digest its keys hold (worked out again at the next key). Returns the plan-cache entries deleted."""
        from memfit.planner.shortcuts import cache

        for store in LIMITS:
            getattr(self, store).clear()
        cache.source_digest.cache_clear()
        cache.environment.cache_clear()
        return cache.clear()

    def sizes(self) -> dict[str, int]:
        """How many entries each store of this process holds."""
        return {store: len(getattr(self, store)) for store in LIMITS}


#: The planner's memo: the one process-global cache of the planner.
MEMO = Memo()
