"""Mixes of sources (memfit.train.data.mixing): drawn by datasets.interleave_datasets with the weights
as probabilities and the run's seed."""

from __future__ import annotations

from collections import Counter

import pytest

pytest.importorskip("datasets")

from memfit.train.data.mixing import mix_order, mix_records


def test_the_same_seed_draws_the_same_mix_and_another_seed_another():
    first = mix_order([30, 10], [0.7, 0.3], seed=0)
    assert first == mix_order([30, 10], [0.7, 0.3], seed=0)
    assert first != mix_order([30, 10], [0.7, 0.3], seed=1)


def test_all_exhausted_draws_every_row_of_every_source_in_the_weights_proportions():
    order = mix_order([300, 20], [0.5, 0.5], seed=0)
    assert {(s, r) for s, r in order} == {(0, r) for r in range(300)} | {(1, r) for r in range(20)}
    counts = Counter(source for source, _ in order)
    assert 0.4 < counts[1] / len(order) < 0.6  # the small source comes back again and again: oversampled
    rows = [r for s, r in order if s == 0]
    assert rows == list(range(300))  # each source keeps its own order; the epoch order is shuffled later


def test_first_exhausted_stops_when_a_source_runs_out():
    order = mix_order([300, 20], [0.5, 0.5], seed=0, stopping_strategy="first_exhausted")
    counts = Counter(source for source, _ in order)
    assert counts[1] == 20 and counts[0] < 100  # most of the large source is left out


def test_records_of_any_form_mix():
    texts = [{"text": f"t{i}"} for i in range(5)]
    chats = [
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": f"a{i}"}]} for i in range(5)
    ]
    mixed = mix_records([texts, chats], [0.5, 0.5], seed=3)
    assert all(r in texts or r in chats for r in mixed)
    assert all(r in mixed for r in texts + chats)
