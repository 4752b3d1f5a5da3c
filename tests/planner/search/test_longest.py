"""The longest sequence a method fits (memfit.planner.search.longest): the boundary is exact, with
and without the step learnt over lengths, and a search whose plans are all made the long way
(``exact``) finds it with plans alone."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import memfit
from memfit.planner.search.driver import fit
from memfit.planner.search.longest import SEQ_STEP, longest_sequence
from memfit.planner.search.request import FitRequest


class _LinePlanner:
    """Stands in for the search's planner: memory is a line in the sequence length (states, plus
    bytes a token), so the longest length that fits can be worked out by hand."""

    def __init__(self, states: int, per_token: int, memory: int, *, exact: bool = False):
        self.states, self.per_token, self.memory, self.exact = states, per_token, memory, exact
        self.optimizers = {"lora": ("adamw",)}
        self.base: dict = {}
        self.count = 0
        self.predicted: list[int] = []

    def _plan(self, knobs):
        total = self.states + knobs["seq_len"] * self.per_token
        return SimpleNamespace(
            spec=dict(knobs),
            fits=total <= self.memory,
            headroom_bytes=self.memory - total,
            device_total_bytes=total,
            details={},
        )

    def __call__(self, **knobs):
        self.count += 1
        return self._plan(knobs)

    def predict(self, sampler, **knobs):
        self.predicted.append(knobs["seq_len"])
        return self._plan(knobs)

    def cannot_fit(self, **knobs) -> bool:
        return False

    def longest_by_hand(self, limit: int) -> int:
        return min((self.memory - self.states) // self.per_token // SEQ_STEP * SEQ_STEP, limit // SEQ_STEP * SEQ_STEP)


@pytest.mark.parametrize("per_token", [1_000, 7_919, 40_000])
@pytest.mark.parametrize("limit", [4096, 131072])
@pytest.mark.parametrize("exact", [False, True])
def test_the_longest_length_is_the_one_every_length_planned_finds(per_token, limit, exact):
    planner = _LinePlanner(states=2 * 2**30, per_token=per_token, memory=3 * 2**30, exact=exact)
    longest, spec = longest_sequence(planner, "lora", limit, effective_batch=4)
    assert longest == planner.longest_by_hand(limit) and spec["seq_len"] == longest
    assert (
        spec["batch_size"] == 1
        and spec["grad_accum"] == 4
        and spec["checkpointing"] == "offload"
        and spec["tiling"] == "on"
    )
    if exact:
        assert planner.predicted == []  # no prediction: every length asked about is planned
    elif limit > 4 * 8192 and longest < limit:
        assert planner.predicted  # long lengths: the boundary is searched on predictions


def test_no_length_fits_where_one_chunk_does_not():
    planner = _LinePlanner(states=4 * 2**30, per_token=1, memory=3 * 2**30)
    assert longest_sequence(planner, "lora", 131072, 1) == (0, None)


def test_longest_sequence_fits_and_one_step_more_does_not():
    result = fit(FitRequest("smollm2-135m", budget="1210MiB", batch_size=1, methods=("lora",)))
    longest = result.max_seq_len["lora"]
    assert 0 < longest < 8192
    spec = {k: v for k, v in result.max_seq_len_specs["lora"].items() if k not in ("gpus", "shard")}
    assert memfit.plan("smollm2-135m", budget="1210MiB", **spec).fits
    spec["seq_len"] = longest + SEQ_STEP
    assert not memfit.plan("smollm2-135m", budget="1210MiB", **spec).fits
    assert set(result.max_seq_len) == {"lora"}  # only the methods searched


def test_an_exact_search_asks_every_plan_exact(monkeypatch, tiny_llama):
    # Until plan() is made the long way by the switch, its plans are made here as they are, the
    # switch taken off: what is tested is that every plan of the search asks for it.
    from memfit.planner.api import plan
    from memfit.planner.search import plans

    asked: list[bool] = []

    def recorded(model, **options):
        asked.append(options.pop("exact", False))
        return plan(model, **options)

    monkeypatch.setattr(plans, "plan", recorded)
    request = FitRequest(tiny_llama, budget="2GiB", batch_size=2, seq_len=64, methods=("lora",), workers=1)
    plain = fit(request)
    assert asked and not any(asked)
    asked.clear()
    exact = fit(
        FitRequest(tiny_llama, budget="2GiB", batch_size=2, seq_len=64, methods=("lora",), workers=1, exact=True)
    )
    assert len(asked) == exact.plans_made and all(asked)
    assert [f.spec for f in exact.fits] == [f.spec for f in plain.fits] and exact.max_seq_len == plain.max_seq_len
