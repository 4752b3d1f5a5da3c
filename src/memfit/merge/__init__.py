"""Merge a PEFT LoRA adapter into a base checkpoint, streaming shard by shard.

    from memfit.merge import merge
    merge("./Llama-3.1-8B", "./runs/my-run/adapter", "./merged", dtype="bf16")

Apart from the layers of the rest of memfit: it reads safetensors and adapter files with its own
small readers, and may import only the bottom layer (:mod:`memfit.files`, :mod:`memfit.units`).
"""

from .api import MergeResult, merge
from .errors import MergeError

__all__ = ["merge", "MergeResult", "MergeError"]
