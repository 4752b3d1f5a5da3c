"""Which path a model's sequence mixers take, and the PyTorch path forced for a simulation."""

from __future__ import annotations

import sys
import types

from memfit.models.build import make_config
from memfit.models.mixer_kernels import _kernel_functions, describe, mixer_kernels, pytorch_mixers

MAMBA2 = {
    "model_type": "mamba2",
    "hidden_size": 64,
    "num_heads": 8,
    "head_dim": 16,
    "n_groups": 2,
    "state_size": 16,
    "num_hidden_layers": 2,
    "vocab_size": 256,
}


def test_a_mamba_model_without_the_packages_runs_the_pytorch_path():
    import importlib.util

    kernels = mixer_kernels(make_config(MAMBA2))
    assert {k.package for k in kernels} == {"mamba_ssm", "causal_conv1d"}
    installed = {p for p in ("mamba_ssm", "causal_conv1d") if importlib.util.find_spec(p) is not None}
    assert {k.package for k in kernels if k.fused} == installed
    described = describe(kernels)
    assert described["simulated"] == "pytorch" and described["packages"] == ["causal-conv1d", "mamba-ssm"]
    assert described["run"] == ("fused kernels" if installed else "pytorch")


def test_a_model_without_such_mixers_has_none():
    llama = {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "vocab_size": 256,
    }
    assert mixer_kernels(make_config(llama)) == []
    assert describe([]) is None


def test_an_installed_kernel_is_seen_and_swapped_for_the_pytorch_code(monkeypatch):
    """transformers binds a package's function where the package imports: a stand-in package shows
    that the binding is recognised as fused, and that pytorch_mixers swaps in the PyTorch function."""
    from transformers.integrations.hub_kernels import use_kernel_func_from_hub_with_fallback

    package = types.ModuleType("memfit_test_kernels")
    package.scan = lambda x: "fused"
    monkeypatch.setitem(sys.modules, "memfit_test_kernels", package)

    @use_kernel_func_from_hub_with_fallback("scan", "memfit_test_kernels")
    def scan(x):
        return "pytorch"

    module = types.ModuleType("memfit_test_modeling")
    module.scan = scan
    assert [(name, info["is_new_implementation"]) for name, info in _kernel_functions(module)] == [("scan", True)]
    assert module.scan(1) == "fused"
    monkeypatch.setattr("memfit.models.mixer_kernels._model_module", lambda config: module)
    with pytorch_mixers(config=None):
        assert module.scan(1) == "pytorch"
    assert module.scan(1) == "fused"
