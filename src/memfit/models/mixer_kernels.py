"""Which code a model's sequence mixers run: transformers' PyTorch path, or a package's fused kernels.

Mamba, Mamba-2, short-convolution and gated-delta-rule mixers (Falcon-H1, Jamba, Bamba, Granite
4.0-H, Nemotron-H, LFM2, Qwen3-Next...) call their scan and convolution through functions that
transformers binds once, when it imports the model's module
(``use_kernel_func_from_hub_with_fallback``): the kernel of ``mamba-ssm``, ``causal-conv1d`` or
``flash-linear-attention`` (``fla``) where that package is installed, else transformers' own
PyTorch code. The choice does not depend on the device: a run on a GPU without the packages runs
the PyTorch path, as a run on the CPU does.

The planner can only simulate the PyTorch path (the packages' Triton and CUDA kernels do not run
on fake tensors). :func:`mixer_kernels` says what a model would run; :func:`pytorch_mixers`
makes the model's module use the PyTorch path for the time of a simulation, so that a plan made
where the packages are installed is still made (and says what it assumed).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

#: Python package -> what pip installs it as.
DISTRIBUTIONS = {"mamba_ssm": "mamba-ssm", "causal_conv1d": "causal-conv1d", "fla": "flash-linear-attention"}


@dataclass(frozen=True)
class MixerKernel:
    """One function of the model's module that a package's kernel can stand in for."""

    name: str  # the function's name in the module (``mamba_chunk_scan_combined``)
    package: str  # the Python package whose kernel it is (``mamba_ssm``)
    fused: bool  # whether the package is installed, so that the module calls its kernel

    @property
    def distribution(self) -> str:
        return DISTRIBUTIONS.get(self.package, self.package)


def mixer_kernels(config) -> list[MixerKernel]:
    """The kernel-backed functions of the module that defines ``config``'s causal LM (none for most
    models), sorted by name."""
    module = _model_module(config)
    if module is None:
        return []
    return sorted(
        (
            MixerKernel(name, str(info["package"]), bool(info["is_new_implementation"]))
            for name, info in _kernel_functions(module)
        ),
        key=lambda k: k.name,
    )


def describe(kernels: list[MixerKernel]) -> dict[str, Any] | None:
    """What a plan says of the mixers (``details.sequence_mixers``): the path it simulated, the path
    the run takes here, and the packages that decide it; None for a model without such mixers."""
    if not kernels:
        return None
    packages = sorted({k.distribution for k in kernels})
    installed = sorted({k.distribution for k in kernels if k.fused})
    return {
        "simulated": "pytorch",
        "run": "fused kernels" if installed else "pytorch",
        "packages": packages,
        "installed": installed,
    }


@contextlib.contextmanager
def pytorch_mixers(config) -> Iterator[None]:
    """Make the model's module call transformers' PyTorch code wherever it would call an installed
    package's kernel, until the block ends (nothing changes where no package is installed)."""
    module = _model_module(config)
    swapped = {}
    if module is not None:
        for name, info in _kernel_functions(module):
            if info["is_new_implementation"]:
                swapped[name] = vars(module)[name]
                setattr(module, name, info["torch_function"])
    try:
        yield
    finally:
        for name, original in swapped.items():
            setattr(module, name, original)


def _kernel_functions(module) -> Iterator[tuple[str, dict]]:
    """(name, closure) of each function in ``module`` made by transformers' kernel-or-PyTorch binding."""
    for name, value in list(vars(module).items()):
        info = _binding(value)
        if info is not None:
            yield name, info


def _binding(value) -> dict | None:
    """The closure of transformers' binding in ``value`` (or in what it wraps), or None."""
    seen = 0
    while callable(value) and seen < 4:
        code = getattr(value, "__code__", None)
        if code is not None and {"implementation", "is_new_implementation", "torch_function", "package"} <= set(
            code.co_freevars
        ):
            return inspect.getclosurevars(value).nonlocals
        value, seen = getattr(value, "__wrapped__", None), seen + 1
    return None


def _model_module(config):
    """The module that defines ``config``'s causal LM class (imported), or None."""
    try:
        from transformers import AutoModelForCausalLM

        model_class = AutoModelForCausalLM._model_mapping[type(config)]
    except (KeyError, ImportError, AttributeError, ValueError):
        return None
    return sys.modules.get(model_class.__module__) or importlib.import_module(model_class.__module__)
