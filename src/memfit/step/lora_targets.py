"""What LoRA adapts in a model, as PEFT is told: linear modules, fused expert weights, routers.

The names a configuration gives (``targets``):

- a linear layer's short name (``q_proj``, ``down_proj``);
- ``experts``: every fused expert weight of every mixture-of-experts layer (each expert its own
  LoRA pair), or one of them, ``experts.gate_up_proj`` (:mod:`memfit.models.experts`);
- a router's short name (``gate``, ``router``): routers are adapted only when named;
- ``all-linear``: every linear layer of the decoder blocks and every expert weight, as all-linear
  adapted a model whose experts were ``nn.Linear`` modules; not the routers (scores, not linear
  maps a token goes through) and not the output head.

PEFT adapts a linear module through ``target_modules`` (``lora.Linear``) and a weight through
``target_parameters`` (its ``ParamWrapper``: per expert a pair of LoRA factors, the update folded
into the weight at each forward). A fused ``gate_up_proj`` holds two projections, gate and up: its
adapter takes rank 2r and alpha 2 alpha, the rule PEFT applies when it fuses adapters of the
unfused layout, so that each projection keeps rank r and the scale alpha / r.

Two facts of PEFT on transformers 5 shape the config. PEFT rewrites the ``target_modules`` of the
mixture-of-experts model types whose checkpoints transformers converts (on creation and again on
loading a saved adapter): the old names of the experts' and routers' layers (``gate_proj``,
``up_proj``, ``down_proj``, ``w1`` to ``w3``, ``gate``) become targets of the fused experts, so a
dense layer of such a name (a shared expert, a dense first layer) would silently lose its adapter.
memfit names that layer's weight instead (``down_proj.weight``), which PEFT keeps as given and wraps
as a parameter: the same LoRA update, and training, the saved adapter and PEFT's loading agree.
Routers are adapted through their weight too: Phi-3.5-MoE's and Llama 4's are ``nn.Linear``
subclasses whose forward returns a tuple, which a ``lora.Linear`` cannot wrap.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from memfit.models.experts import EXPERTS, expert_modules, expert_weights, has_experts, routers
from memfit.models.layers import linear_names_in_layers
from memfit.spec import ALL_LINEAR

#: The expert weight that holds two projections (gate and up) side by side.
FUSED_PAIR = "gate_up_proj"


@dataclass(frozen=True)
class LoraTargets:
    """PEFT's ``target_modules`` and ``target_parameters`` for a model, and the rank and alpha patterns
    of the fused pairs. ``modules`` is ``all-linear`` (PEFT's own) for a model without experts."""

    modules: tuple[str, ...] | str
    parameters: tuple[str, ...] = ()
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)


def expert_target_names(model: nn.Module) -> list[str]:
    """``experts.<weight>`` for each fused expert weight the model has (``experts.gate_up_proj``...)."""
    names = {f"{EXPERTS}.{w.name}" for module in expert_modules(model).values() for w in expert_weights(module)}
    return sorted(names)


def router_names(model: nn.Module) -> list[str]:
    """Short names of the model's routers (``gate``, ``router``)."""
    return sorted({name.rsplit(".", 1)[-1] for name in routers(model)})


def available_targets(model: nn.Module) -> list[str]:
    """Every name ``targets`` takes for this model: its linear layers, ``experts`` and each expert
    weight, and its routers."""
    experts = expert_target_names(model)
    return linear_names_in_layers(model) + ([EXPERTS, *experts] if experts else []) + router_names(model)


def unknown_targets(model: nn.Module, names) -> list[str]:
    """The names among ``names`` that name nothing in this model."""
    known = set(available_targets(model))
    return [name for name in names if name not in known]


def lora_targets(
    model: nn.Module, targets: tuple[str, ...], rank: int, alpha: float, refused: list[str]
) -> LoraTargets:
    """The PEFT targets of ``targets`` (already checked) for ``model``; ``refused``: linear names PEFT
    refuses in this model (left out of all-linear)."""
    if not has_experts(model):
        if targets == (ALL_LINEAR,):
            return LoraTargets(modules=ALL_LINEAR)
        return LoraTargets(modules=tuple(targets))
    linear = [n for n in linear_names_in_layers(model) if n not in refused]
    experts = expert_target_names(model)
    if targets == (ALL_LINEAR,):
        modules, parameters = linear, list(experts)
    else:
        modules = [n for n in targets if n in linear]
        parameters = [e for e in experts if EXPERTS in targets or e in targets]
        parameters += [f"{n}.weight" for n in router_names(model) if n in targets]
    claimed = peft_claimed_names(model, modules)
    parameters += [f"{n}.weight" for n in modules if n in claimed]
    modules = [n for n in modules if n not in claimed]
    pairs = [p for p in parameters if p == f"{EXPERTS}.{FUSED_PAIR}"]
    return LoraTargets(
        modules=tuple(modules),
        parameters=tuple(parameters),
        rank_pattern={_pattern(p): 2 * rank for p in pairs},
        alpha_pattern={_pattern(p): 2 * alpha for p in pairs},
    )


def _pattern(parameter: str) -> str:
    """PEFT's rank / alpha pattern for a parameter target (matched against ``<module>.<parameter>``)."""
    return r".*\." + parameter.replace(".", r"\.")


def peft_claimed_names(model: nn.Module, names) -> set[str]:
    """The linear names PEFT's transformers-5 conversion would move from ``target_modules`` to the
    experts' parameters in this model (see the module doc), by PEFT's own conversion: one name at a
    time, since PEFT also refuses half of a fused pair (``gate_proj`` without ``up_proj``)."""
    try:
        from peft import LoraConfig
        from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers
    except ImportError:  # a PEFT (or transformers) without the conversion converts nothing
        return set()
    claimed = set()
    for name in names:
        probe = LoraConfig(target_modules=[name])
        try:
            convert_peft_config_for_transformers(probe, model=model, conversions=None)
        except ValueError:
            claimed.add(name)
            continue
        if name not in set(probe.target_modules or ()):
            claimed.add(name)
    return claimed


def parameter_targets_problem(targets: LoraTargets, dropout: float, dora: bool) -> str | None:
    """Why PEFT cannot put these adapters on weights (its ``ParamWrapper`` takes no dropout and no
    DoRA), or None."""
    if not targets.parameters:
        return None
    if dora:
        return "DoRA"
    if dropout:
        return "dropout"
    return None
