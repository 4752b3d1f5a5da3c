"""A row cut into sequence-parallel shards: labels shifted over the whole row, global positions, a
filler example, the heads each rank takes."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from memfit.step.batch import DOCUMENTS, PADDED, collate  # noqa: E402
from memfit.step.labels import IGNORE_INDEX  # noqa: E402
from memfit.step.sequence_parallel import (  # noqa: E402
    SequenceGroup,
    gather_heads,
    heads_problem,
    layout_problem,
    scatter_heads,
    shard_batch,
    shard_tokens,
)


def _row(*lengths: int) -> dict:
    start, examples = 10, []
    for length in lengths:
        ids = list(range(start, start + length))
        examples.append({"input_ids": ids, "labels": ids})
        start += length
    return collate(examples, pad_token_id=2, layout=DOCUMENTS)


def test_shards_take_the_next_token_of_the_whole_row_as_their_labels():
    row = _row(5, 3)  # 8 tokens: two shards of 4
    first, second = (shard_batch(row, SequenceGroup(2, rank), 2) for rank in (0, 1))
    assert first["input_ids"].tolist() == [[10, 11, 12, 13]]
    assert second["input_ids"].tolist() == [[14, 15, 16, 17]]
    # the last token of shard 0 predicts the first token of shard 1 (the same example)
    assert first["shift_labels"].tolist() == [[11, 12, 13, 14]]
    # token 14 ends the first example: the next is another example's first token, which takes no loss
    assert second["shift_labels"].tolist() == [[IGNORE_INDEX, 16, 17, IGNORE_INDEX]]
    # positions are the whole row's, per example (rotary embeddings)
    assert first["position_ids"].tolist() == [[0, 1, 2, 3]] and second["position_ids"].tolist() == [[4, 0, 1, 2]]
    assert first["documents"].lengths == (5, 3) == second["documents"].lengths
    assert shard_tokens(first) + shard_tokens(second) == 6  # the single process's labelled tokens: 4 + 2


def test_a_row_that_does_not_split_evenly_gets_a_filler_example_without_loss():
    row = _row(4, 3)  # 7 tokens over 2 ranks: one filler token
    shards = [shard_batch(row, SequenceGroup(2, rank), 2) for rank in (0, 1)]
    assert [s["input_ids"].shape[1] for s in shards] == [4, 4]
    assert shards[1]["input_ids"][0, -1].item() == 2 and shards[1]["shift_labels"][0, -1].item() == IGNORE_INDEX
    assert shards[1]["documents"].lengths == (4, 3, 1)
    assert shards[1]["documents"].cu_seqlens.tolist() == [0, 4, 7, 8]
    assert [s["input_tokens"] for s in shards] == [4, 3]


def test_heads_split_over_ranks_or_the_degree_is_refused():
    class Config:
        num_attention_heads, num_key_value_heads = 32, 8

    assert heads_problem(Config, 8) is None
    assert heads_problem(Config, 16) is None  # key/value heads repeated for two ranks each
    message = heads_problem(Config, 3)
    assert "--sequence-parallel 3" in message and "32 attention heads" in message
    Config.num_key_value_heads = 6
    Config.num_attention_heads = 24
    assert "6 key/value heads" in heads_problem(Config, 4)
    assert layout_problem(PADDED, 2) is not None and layout_problem(DOCUMENTS, 2) is None


def test_the_exchange_keeps_the_shapes_of_each_side_of_attention():
    # Without a process group the exchange is a copy of the right size: rank 0's view of the sizes.
    group = SequenceGroup(4)
    query, key = torch.randn(1, 8, 6, 16, requires_grad=True), torch.randn(1, 2, 6, 16)
    assert scatter_heads(query, group).shape == (1, 2, 24, 16)
    assert scatter_heads(key, group).shape == (1, 1, 24, 16)  # 2 key/value heads repeated for 4 ranks
    out = gather_heads(torch.randn(1, 24, 2, 16), group)
    assert out.shape == (1, 6, 8, 16)
    scatter_heads(query, group).sum().backward()
    assert query.grad.shape == query.shape


def test_sequence_parallel_is_checked_against_the_other_knobs():
    from memfit.spec import SpecError, make_spec

    assert make_spec(gpus=8, shard="fsdp", sequence_parallel=4, seq_len=4096).sequence_parallel == 4
    for knobs, says in [
        (dict(gpus=6, shard="fsdp", sequence_parallel=4), "--sequence-parallel 4 does not divide --gpus 6"),
        (dict(gpus=2, shard="fsdp", sequence_parallel=2, seq_len=33), "--seq-len 33 cannot be cut into 2"),
        (dict(gpus=2, shard="fsdp", sequence_parallel=2, objective="dpo"), "--objective dpo"),
        (dict(gpus=2, shard="fsdp", sequence_parallel=2, padding_free="off"), "--padding-free off"),
    ]:
        with pytest.raises(SpecError, match=says):
            make_spec(**knobs)
