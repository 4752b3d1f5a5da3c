"""Names of dtypes: the --dtype spellings users type and the codes safetensors files use.

Kept free of a torch import at module level so the command line can validate --dtype
before paying for torch.
"""

from __future__ import annotations

from .errors import MergeError

# --dtype spelling -> safetensors dtype code
DTYPE_ALIASES: dict[str, str] = {
    "bf16": "BF16",
    "bfloat16": "BF16",
    "fp16": "F16",
    "float16": "F16",
    "half": "F16",
    "fp32": "F32",
    "float32": "F32",
    "float": "F32",
}

# safetensors code -> torch attribute name
_TORCH_NAMES: dict[str, str] = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "U16": "uint16",
    "U32": "uint32",
    "U64": "uint64",
    "BOOL": "bool",
}

# The dtypes a LoRA merge may read and write: float8 and integer tensors are quantized or
# index data and are copied through untouched.
FLOAT_CODES = frozenset({"F64", "F32", "F16", "BF16"})

# config.json spelling of each float code
CONFIG_NAMES: dict[str, str] = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}

BYTES_PER_ELEMENT: dict[str, int] = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "U16": 2,
    "U32": 4,
    "U64": 8,
    "BOOL": 1,
}


def parse_dtype(value: str | None) -> str | None:
    """Turn a --dtype value into a safetensors code (None keeps each tensor's own dtype)."""
    if value is None:
        return None
    code = DTYPE_ALIASES.get(value.strip().lower())
    if code is None:
        raise MergeError(
            f"--dtype {value!r} is not supported. Use one of bf16, fp16, fp32 (or leave it out to keep the base's dtype)."
        )
    return code


def torch_dtype(code: str):
    """The torch dtype for a safetensors code."""
    import torch

    name = _TORCH_NAMES.get(code)
    if name is None or not hasattr(torch, name):
        raise MergeError(f"tensor dtype {code!r} is not supported by this torch build.")
    return getattr(torch, name)


def code_of(dtype) -> str:
    """The safetensors code for a torch dtype."""
    name = str(dtype).removeprefix("torch.")
    for code, torch_name in _TORCH_NAMES.items():
        if torch_name == name:
            return code
    raise MergeError(f"torch dtype {dtype} has no safetensors code.")
