"""Mixture-of-experts blocks inside a causal LM: the experts' weights and the routers.

transformers 5 keeps a block's experts fused: one module (named ``experts`` in every family) whose
weights are 3-D parameters ``[experts, out, in]`` (``gate_up_proj``, ``down_proj``; gpt-oss and
Llama 4 store them ``[experts, in, out]``, gpt-oss with ``[experts, out]`` biases beside them).
Beside it sits the router (``gate`` or ``router``): a ``[experts, hidden]`` weight, in Phi-3.5-MoE
and Llama 4 an ``nn.Linear`` subclass whose forward returns a tuple, so it is no plain linear map
to adapt or quantize. These queries read module types, names and shapes only, never values.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

#: The attribute name of the experts module in every transformers mixture-of-experts block.
EXPERTS = "experts"


@dataclass(frozen=True)
class ExpertWeight:
    """One fused expert weight: ``num_experts`` matrices mapping ``in_features`` to ``out_features``,
    stored ``[experts, in, out]`` when ``transposed`` (else ``[experts, out, in]``), with the name of
    its ``[experts, out]`` bias where it has one."""

    name: str
    num_experts: int
    in_features: int
    out_features: int
    transposed: bool
    bias: str | None = None

    @property
    def numel(self) -> int:
        """Elements of the weight (all experts), its bias not counted."""
        return self.num_experts * self.in_features * self.out_features


def is_experts(module: nn.Module) -> bool:
    """A fused experts module: it holds 3-D parameters itself (or, 4-bit, says it stands for them),
    and is no convolution (whose weights are 3-D too: a Mamba or linear-attention mixer's)."""
    if getattr(module, "expert_weights", None) is not None:
        return True
    if isinstance(module, nn.modules.conv._ConvNd):
        return False
    return any(p is not None and p.dim() == 3 for p in module._parameters.values())


def expert_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The fused experts modules of ``model`` by full name (one per mixture-of-experts layer)."""
    found = {}
    for name, module in model.named_modules():
        # Adapter wrappers (PEFT's ParamWrapper) hold the experts module as their base layer: the
        # innermost module is the one meant.
        if is_experts(module) and not hasattr(module, "base_layer"):
            found[name] = module
    return found


def expert_weights(module: nn.Module) -> list[ExpertWeight]:
    """The fused weights of an experts module, in the order the module holds them."""
    given = getattr(module, "expert_weights", None)
    if given is not None:
        return list(given)
    weights = []
    transposed = _transposed(module)
    for name, param in module._parameters.items():
        if param is None or param.dim() != 3:
            continue
        num_experts, first, second = (int(n) for n in param.shape)
        in_features, out_features = (first, second) if transposed else (second, first)
        bias = f"{name}_bias" if module._parameters.get(f"{name}_bias") is not None else None
        weights.append(ExpertWeight(name, num_experts, in_features, out_features, transposed, bias))
    return weights


def _transposed(module: nn.Module) -> bool:
    """Whether ``module`` stores its weights ``[experts, in, out]``: what transformers' experts classes
    say (``is_transposed``); for the few without the flag (Llama 4's, which multiplies ``x @ W``), read
    from where the hidden size sits, the input of the first projection and the output of ``down_proj``."""
    said = getattr(module, "is_transposed", None)
    if said is not None:
        return bool(said)
    hidden = getattr(module, "hidden_size", None) or getattr(getattr(module, "config", None), "hidden_size", None)
    shapes = {name: tuple(p.shape[1:]) for name, p in module._parameters.items() if p is not None and p.dim() == 3}
    for name, (first, second) in sorted(shapes.items(), key=lambda item: item[0] == "down_proj"):
        if hidden is None or first == second or hidden not in (first, second):
            continue
        return (second == hidden) if name == "down_proj" else (first == hidden)
    return False


def routers(model: nn.Module) -> dict[str, nn.Module]:
    """The routers of ``model`` by full name: beside an experts module in its block, a module whose
    ``[experts, hidden]`` weight scores each token for each expert."""
    found = {}
    for name, module in model.named_modules():
        children = dict(module.named_children())
        experts = children.get(EXPERTS)
        if experts is None:
            continue
        experts = _innermost(experts)
        if not is_experts(experts):
            continue
        count = expert_weights(experts)[0].num_experts if expert_weights(experts) else None
        for child_name, child in children.items():
            weight = getattr(_innermost(child), "weight", None)
            if child_name != EXPERTS and weight is not None and weight.dim() == 2 and int(weight.shape[0]) == count:
                found[f"{name}.{child_name}" if name else child_name] = child
    return found


def _innermost(module: nn.Module) -> nn.Module:
    while hasattr(module, "base_layer"):
        module = module.base_layer
    return module


def router_ids(model: nn.Module) -> set[int]:
    """``id()`` of each router module (and of what adapter wrappers hold), for quick membership tests."""
    ids = set()
    for module in routers(model).values():
        ids.add(id(module))
        ids.add(id(_innermost(module)))
    return ids


def on_experts(name: str) -> bool:
    """Whether the parameter of full name ``name`` lies in an experts module: an expert weight, or an
    adapter on one (PEFT's ``...mlp.experts.lora_A.default.weight``, nested wrappers' ``...experts.base_layer...``).
    A shared expert (``shared_expert``, ``shared_experts``) is a dense MLP, not one of the experts."""
    return EXPERTS in name.split(".")


def has_experts(model: nn.Module) -> bool:
    """Whether ``model`` has any fused experts module."""
    return any(is_experts(m) for m in model.modules())


def expert_parameter_count(model: nn.Module) -> int:
    """Elements of every expert weight and bias in ``model`` (a 4-bit weight counted unpacked)."""
    total = 0
    for module in expert_modules(model).values():
        for weight in expert_weights(module):
            total += weight.numel + (weight.num_experts * weight.out_features if weight.bias else 0)
    return total
