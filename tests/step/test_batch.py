"""A micro-batch's layout: padded rows with a mask only where there is padding, or one row of
documents with their bounds."""

from __future__ import annotations

import pytest
import torch

from memfit.step.batch import DOCUMENTS, PADDED, Documents, collate, count_tokens, labelled_tokens, to_device


def test_padded_rows_pad_right_and_mask_only_padding():
    batch = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8], "labels": [8]}]
    out = collate(batch, pad_token_id=2)
    assert set(out) == {"input_ids", "labels", "attention_mask"}
    assert all(t.dtype == torch.long and t.shape == (2, 3) for t in out.values())
    assert out["input_ids"].tolist() == [[5, 6, 7], [8, 2, 2]]
    assert out["labels"].tolist() == [[-100, 6, 7], [8, -100, -100]]
    assert out["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert count_tokens(out) == 4
    # No padding, no mask: an all-ones mask would only make the model check it.
    same = collate([{"input_ids": [1, 2], "labels": [1, 2]}, {"input_ids": [3, 4], "labels": [3, 4]}], 0, layout=PADDED)
    assert set(same) == {"input_ids", "labels"} and count_tokens(same) == 4
    packed = collate(
        [
            {"input_ids": [1, 2], "labels": [1, 2], "position_ids": [0, 0]},
            {"input_ids": [3], "labels": [3], "position_ids": [4]},
        ],
        0,
    )
    assert packed["position_ids"].tolist() == [[0, 0], [4, 0]]
    with pytest.raises(ValueError, match="pad_token_id must be a non-negative integer, got None"):
        collate(batch, pad_token_id=None)
    with pytest.raises(ValueError, match="layout: 'rows' is not one of padded, documents"):
        collate(batch, 0, layout="rows")


def test_documents_are_one_row_with_bounds_positions_and_no_label_across_them():
    batch = [{"input_ids": [5, 6, 7], "labels": [5, 6, 7]}, {"input_ids": [8, 9], "labels": [-100, 9]}]
    out = collate(batch, pad_token_id=2, layout=DOCUMENTS)
    assert out["input_ids"].tolist() == [[5, 6, 7, 8, 9]]
    # The first token of each document would be predicted from the one before: never trained.
    assert out["labels"].tolist() == [[-100, 6, 7, -100, 9]]
    assert out["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    documents = out["documents"]
    assert documents.lengths == (3, 2) and documents.cu_seqlens.tolist() == [0, 3, 5]
    assert documents.cu_seqlens.dtype == torch.int32 and documents.max_length == 3 and documents.total == 5
    assert "attention_mask" not in out and count_tokens(out) == 5 and labelled_tokens(out["labels"]) == 3
    moved = to_device(out, torch.device("cpu"))
    assert isinstance(moved["documents"], Documents)


def test_packed_rows_split_into_documents_where_positions_restart():
    # A packed row: an example continued from the previous row (positions 3, 4), then two examples.
    row = {
        "input_ids": [1, 2, 3, 4, 5, 6, 7],
        "labels": [1, 2, -100, 4, 5, -100, 7],
        "position_ids": [3, 4, 0, 1, 2, 0, 1],
    }
    out = collate([row, {"input_ids": [8, 9], "labels": [-100, 9], "position_ids": [0, 1]}], 0, layout=DOCUMENTS)
    assert out["documents"].lengths == (2, 3, 2, 2)
    assert out["position_ids"].tolist() == [[3, 4, 0, 1, 2, 0, 1, 0, 1]]
    assert out["labels"].tolist() == [[-100, 2, -100, 4, 5, -100, 7, -100, 9]]
