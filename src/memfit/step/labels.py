"""The label that marks a token as taking no loss, shared by the data pipeline and the losses.

Prompt tokens (when only responses are trained) and padding carry it. -100 is the value PyTorch's
``cross_entropy`` ignores by default and transformers' models use. Torch-free, so the data pipeline
can read it without importing torch.
"""

from __future__ import annotations

IGNORE_INDEX = -100
