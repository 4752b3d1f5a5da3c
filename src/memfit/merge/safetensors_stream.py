"""Write a safetensors file one tensor at a time.

`safetensors.torch.save_file` needs every tensor of a shard in memory at once (and turns each
into bytes first), so a shard costs about twice its size in RAM. The format itself does not
need that: the header only holds names, dtypes, shapes and byte offsets, all known before any
data is computed. So the header is written first and each tensor's bytes follow as soon as the
tensor exists, after which it can be freed.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

from .dtypes import BYTES_PER_ELEMENT


@dataclass(frozen=True)
class TensorSpec:
    """What the header says about one tensor."""

    name: str
    dtype: str  # safetensors code, e.g. "BF16"
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * BYTES_PER_ELEMENT[self.dtype]


def data_order(specs: list[TensorSpec]) -> list[TensorSpec]:
    """Order tensors in the data section: wider dtypes first, then by name.

    The header is padded to 8 bytes and every tensor's size is a multiple of its element size,
    so this order keeps each tensor aligned to its element size, which is what readers that
    map the file straight into typed arrays want.
    """
    return sorted(specs, key=lambda s: (-BYTES_PER_ELEMENT[s.dtype], s.name))


def build_header(specs: list[TensorSpec], metadata: dict[str, str]) -> bytes:
    """The length prefix plus the JSON header, padded with spaces to a multiple of 8 bytes."""
    header: dict[str, object] = {"__metadata__": dict(metadata)}
    offset = 0
    for spec in data_order(specs):
        header[spec.name] = {
            "dtype": spec.dtype,
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    body = json.dumps(header, separators=(",", ":")).encode("utf-8")
    body += b" " * (-(8 + len(body)) % 8)
    return struct.pack("<Q", len(body)) + body


class StreamingWriter:
    """Writes `specs` to `path`; call `write(name, tensor)` in `order` and then `close()`."""

    def __init__(self, path: Path, specs: list[TensorSpec], metadata: dict[str, str] | None = None):
        self.path = Path(path)
        self.order = data_order(specs)
        self._next = 0
        self._file = open(self.path, "wb")
        self._file.write(build_header(specs, metadata or {"format": "pt"}))

    def write(self, name: str, tensor) -> None:
        """Append the bytes of `tensor`, which must be the next tensor in `order`."""
        import torch

        from .dtypes import code_of

        spec = self.order[self._next]
        if name != spec.name:
            raise RuntimeError(f"tensor {name!r} written out of order; expected {spec.name!r}")
        if code_of(tensor.dtype) != spec.dtype or tuple(tensor.shape) != spec.shape:
            raise RuntimeError(
                f"tensor {name!r} is {code_of(tensor.dtype)} {tuple(tensor.shape)}, header says {spec.dtype} {spec.shape}"
            )
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        if flat.numel():
            # a uint8 view of the same memory: no copy for tensors already on the CPU
            self._file.write(memoryview(flat.view(torch.uint8).numpy()))
        self._next += 1

    def close(self) -> None:
        """Flush to disk; refuses to leave a file whose header promises tensors never written."""
        missing = [s.name for s in self.order[self._next :]]
        self._file.flush()
        import os

        os.fsync(self._file.fileno())
        self._file.close()
        if missing:
            raise RuntimeError(f"{self.path.name}: {len(missing)} tensors never written, first {missing[0]!r}")

    def abort(self) -> None:
        """Close without checks (the caller removes the file)."""
        self._file.close()


def read_offsets(path: Path) -> tuple[int, dict[str, tuple[int, int]]]:
    """Where each tensor's bytes live in a safetensors file: (data start, name -> [begin, end)).

    Used to copy tensors the merge does not change as plain bytes, with ordinary reads: no
    tensor is built and no file page is mapped into the process.
    """
    with open(path, "rb") as handle:
        (header_len,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(header_len))
    offsets = {name: tuple(entry["data_offsets"]) for name, entry in header.items() if name != "__metadata__"}
    return 8 + header_len, offsets


def copy_bytes(
    writer: StreamingWriter, name: str, source: Path, start: int, end: int, chunk_bytes: int = 16 * 2**20
) -> None:
    """Write tensor `name` by copying bytes [start, end) of `source` in chunks of `chunk_bytes`."""
    spec = writer.order[writer._next]
    if name != spec.name:
        raise RuntimeError(f"tensor {name!r} written out of order; expected {spec.name!r}")
    if end - start != spec.nbytes:
        raise RuntimeError(f"tensor {name!r} has {end - start} bytes in {source.name}, header says {spec.nbytes}")
    buffer = bytearray(min(chunk_bytes, max(spec.nbytes, 1)))
    view = memoryview(buffer)
    with open(source, "rb") as handle:
        handle.seek(start)
        left = end - start
        while left:
            got = handle.readinto(view[: min(left, len(buffer))])
            if not got:
                raise RuntimeError(f"{source.name} ends before tensor {name!r} does")
            writer._file.write(view[:got])
            left -= got
    writer._next += 1
