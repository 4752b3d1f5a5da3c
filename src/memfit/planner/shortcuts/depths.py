"""Which cut-down models a plan simulates, and how their figures add up to the full depth.

A step's memory is a sum over its decoder layers plus what the rest of the model holds, and a
layer's share depends on its kind only (:mod:`memfit.models.layer_kinds`): a Mamba layer holds
what every other Mamba layer of the model holds, an attention layer what every attention layer
holds. So the planner simulates a *base* model that holds every kind, and for each kind the base
with one more layer of that kind; each figure of the full model is the base's plus, for each kind,
its number of further layers in the full model times what one more layer of it added:

    full = base + sum over kinds k of (n_k - base_k) * (with_one_more_k - base)

The base begins with the model's own first layer (its input, the embedding output, needs no
gradient: it is unlike the others) followed by one layer of each kind in the order the kinds first
come; the extra layer goes in the middle of the base, so that every sample begins and ends with
the same layers and the same operations (:mod:`memfit.planner.shortcuts.peaks`
lines their events up). A model of one kind is simulated at two and three layers, as always.

When the config cannot express such cuts (Jamba computes its kinds from the depth) the pattern's
period is sampled instead, two and three whole periods, which holds where the depth is a whole
number of periods; a model whose layers are coupled (Zamba's shared attention blocks, Inkling 2's
attention over earlier layers' outputs), or that is too shallow to gain from cutting, is simulated whole (:func:`plan_depths` returns None).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from fractions import Fraction
from typing import Any


@dataclass(frozen=True)
class DepthPlan:
    """The cuts to simulate (each a tuple of the full model's layer indices that its layers copy;
    the first is the base) and the weight of each further cut's difference from the base."""

    samples: tuple[tuple[int, ...], ...]
    weights: tuple[Fraction, ...]

    def combine(self, values: list[int]) -> int:
        """The full model's figure from the samples' ``values``: base plus the weighted differences."""
        base = values[0]
        return round(base + sum((w * (v - base) for w, v in zip(self.weights, values[1:])), Fraction(0)))

    def float_weights(self) -> list[float]:
        """Each sample's weight in :meth:`combine` (the base's first), as floats: for comparing moments."""
        return [float(1 - sum(self.weights)), *(float(w) for w in self.weights)]

    @property
    def sizes(self) -> list[int]:
        """The depth of each simulated cut."""
        return [len(s) for s in self.samples]


def plan_depths(config_dict: dict[str, Any]) -> DepthPlan | None:
    """The cuts that give the step of the model in ``config_dict`` at full depth, or None when it is
    simulated whole. Kept in the memo by config: each is checked by building its cuts, and a search
    plans one model many times."""
    from memfit.planner.shortcuts.memo import MEMO, config_key

    key = config_key(config_dict)
    if key not in MEMO.depth_plans:
        MEMO.keep("depth_plans", key, _plan(config_dict))
    return MEMO.depth_plans[key]


def _plan(config_dict: dict[str, Any]) -> DepthPlan | None:
    from memfit.models.layer_kinds import cut_keeps_kinds, layer_pattern

    pattern = layer_pattern(config_dict)
    num_layers = pattern.num_layers
    if pattern.coupled:
        return None
    if len(set(pattern.kinds)) == 1:
        return None if num_layers <= 3 else DepthPlan(samples=((0, 1), (0, 1, 2)), weights=(Fraction(num_layers - 2),))
    for plan in (_by_kind(pattern.kinds), _by_period(pattern.kinds, pattern.period())):
        if (
            plan is not None
            and max(plan.sizes) < num_layers
            and all(cut_keeps_kinds(config_dict, s) for s in plan.samples)
        ):
            return plan
    return None


def _by_kind(kinds: tuple[int, ...]) -> DepthPlan:
    """The base (first layer, then one layer of each kind found after it) and one sample a kind
    whose number in the full model differs from the base's."""
    firsts: dict[int, int] = {}
    for index, kind in enumerate(kinds[1:], start=1):
        firsts.setdefault(kind, index)
    ordinary = list(firsts.values())
    middle = (len(ordinary) + 1) // 2
    base = (0, *ordinary)
    in_base = Counter(kinds[i] for i in base)
    in_model = Counter(kinds)
    samples, weights = [base], []
    for kind, index in firsts.items():
        if in_model[kind] != in_base[kind]:
            samples.append((0, *ordinary[:middle], index, *ordinary[middle:]))
            weights.append(Fraction(in_model[kind] - in_base[kind]))
    return DepthPlan(samples=tuple(samples), weights=tuple(weights))


def _by_period(kinds: tuple[int, ...], period: int) -> DepthPlan | None:
    """Two and three whole periods of the pattern (None unless the depth is a whole number of
    periods, more than three)."""
    num_layers = len(kinds)
    if num_layers % period or num_layers <= 3 * period:
        return None
    return DepthPlan(
        samples=(tuple(range(2 * period)), tuple(range(3 * period))),
        weights=(Fraction(num_layers - 2 * period, period),),
    )
