"""The order of in-memory examples: BatchIterator (memfit.train.data.order)."""

from __future__ import annotations

import json

import pytest

from memfit.train.data import BatchIterator


def test_batch_iterator_resumes_exactly_mid_epoch():
    examples = list(range(23))
    straight = BatchIterator(examples, batch_size=5, seed=7)
    expected = [next(straight) for _ in range(14)]  # 5 batches an epoch: crosses two epoch ends
    for stop in (0, 3, 5, 7):
        first = BatchIterator(examples, batch_size=5, seed=7)
        seen = [next(first) for _ in range(stop)]
        state = json.loads(json.dumps(first.state_dict()))  # survives a checkpoint file
        resumed = BatchIterator(examples, batch_size=5, seed=7)
        resumed.load_state_dict(state)
        assert seen + [next(resumed) for _ in range(14 - stop)] == expected
    assert first.state_dict()["epoch"] == 1 and first.state_dict()["position"] == 10


def test_batch_iterator_epochs_are_permutations_and_seeded():
    iterator = BatchIterator(list(range(10)), batch_size=4, seed=1)
    assert iterator.batches_per_epoch() == 3
    epoch0 = [i for _ in range(3) for i in next(iterator)]
    epoch1 = [i for _ in range(3) for i in next(iterator)]
    assert sorted(epoch0) == sorted(epoch1) == list(range(10)) and epoch0 != epoch1
    assert next(BatchIterator(list(range(10)), 4, seed=2)) != epoch0[:4]
    assert next(BatchIterator(list(range(10)), 4, shuffle=False)) == [0, 1, 2, 3]
    dropping = BatchIterator(list(range(10)), batch_size=4, seed=1, drop_last=True)
    assert [len(next(dropping)) for _ in range(4)] == [4, 4, 4, 4] and dropping.state_dict()["epoch"] == 1


def test_batch_iterator_counts_epochs_as_the_trainer_and_the_examples_it_handed_out():
    iterator = BatchIterator(list(range(10)), batch_size=4, seed=1)  # batches of 4, 4 and 2
    assert iterator.epochs_done() == 0.0
    done = []
    for _ in range(6):
        next(iterator)
        done.append(iterator.epochs_done())
    # epoch + batches of this epoch / batches per epoch, 1.0 once the first epoch's last batch is out.
    assert done == pytest.approx([1 / 3, 2 / 3, 1.0, 4 / 3, 5 / 3, 2.0], rel=1e-12)
    assert iterator.handed_out == 20
    resumed = BatchIterator(list(range(10)), batch_size=4, seed=1)
    resumed.load_state_dict(json.loads(json.dumps(iterator.state_dict())))
    assert resumed.epochs_done() == 2.0 and resumed.handed_out == 0  # the position is saved, the count is not
    dropping = BatchIterator(list(range(10)), batch_size=4, seed=1, drop_last=True)  # two batches an epoch
    assert [(next(dropping), dropping.epochs_done())[1] for _ in range(3)] == [0.5, 1.0, 1.5]


def test_batch_iterator_refuses_a_state_from_other_data():
    state = BatchIterator(list(range(10)), batch_size=4, seed=1).state_dict()
    with pytest.raises(
        ValueError,
        match="num_examples: saved 10, now 11; seed: saved 1, now 2|seed: saved 1, now 2; num_examples: saved 10, now 11",
    ):
        BatchIterator(list(range(11)), batch_size=4, seed=2).load_state_dict(state)
