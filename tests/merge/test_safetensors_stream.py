"""The streaming writer produces files safetensors itself reads back exactly."""

from __future__ import annotations

import pytest

from memfit.merge.safetensors_stream import (
    StreamingWriter,
    TensorSpec,
    build_header,
    data_order,
)

torch = pytest.importorskip("torch")


def test_round_trip_mixed_dtypes(tmp_path):
    from safetensors import safe_open

    from memfit.merge.dtypes import code_of

    tensors = {
        "b.bf16": torch.randn(3, 5).to(torch.bfloat16),
        "a.f32": torch.randn(7),
        "c.i64": torch.arange(4),
        "d.bool": torch.tensor([True, False, True]),
        "e.scalar": torch.tensor(2.5, dtype=torch.float16),
        "f.empty": torch.zeros(0, 4),
    }
    specs = [TensorSpec(k, code_of(v.dtype), tuple(v.shape)) for k, v in tensors.items()]
    writer = StreamingWriter(tmp_path / "x.safetensors", specs, {"format": "pt"})
    for spec in writer.order:
        writer.write(spec.name, tensors[spec.name])
    writer.close()
    with safe_open(str(tmp_path / "x.safetensors"), "pt") as handle:
        assert handle.metadata() == {"format": "pt"}
        assert sorted(handle.keys()) == sorted(tensors)
        for name, tensor in tensors.items():
            assert torch.equal(handle.get_tensor(name), tensor), name


def test_header_is_padded_and_tensors_aligned():
    specs = [TensorSpec("x", "BF16", (3,)), TensorSpec("y", "F32", (2,)), TensorSpec("z", "U8", (1,))]
    header = build_header(specs, {"format": "pt"})
    assert len(header) % 8 == 0
    assert [s.name for s in data_order(specs)] == ["y", "x", "z"]


def test_out_of_order_and_missing_writes_are_errors(tmp_path):
    specs = [TensorSpec("a", "F32", (2,)), TensorSpec("b", "F32", (2,))]
    writer = StreamingWriter(tmp_path / "x.safetensors", specs)
    with pytest.raises(RuntimeError, match="out of order"):
        writer.write("b", torch.zeros(2))
    with pytest.raises(RuntimeError, match="header says"):
        writer.write("a", torch.zeros(3))
    writer.write("a", torch.zeros(2))
    with pytest.raises(RuntimeError, match="never written"):
        writer.close()
