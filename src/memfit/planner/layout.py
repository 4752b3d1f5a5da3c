"""What a model's states take, before any step runs: its parameter layout, and the floor under any plan.

:func:`param_layout` builds one decoder layer of each kind on ``meta`` (a hybrid's Mamba and
attention layers, say), prepared as the trainer prepares them, and counts the bytes of every
parameter, each layer as often as the full model holds its kind (the sharding arithmetic divides
them among ranks). :func:`memory_lower_bound` adds up what the model's states alone need (weights,
gradients, optimizer states): a floor under any plan of full fine-tuning on one GPU, which lets
``memfit fit`` rule a setting out without simulating it (:func:`proven_over_budget`).
"""

from __future__ import annotations

from typing import Any

from memfit.planner.exact.runtime import runtime_overhead
from memfit.planner.inputs import resolve
from memfit.planner.shortcuts.memo import MEMO, config_key
from memfit.planner.target import Target
from memfit.spec import RunSpec


def param_layout(config: dict[str, Any], spec: RunSpec, *, remember: bool = True):
    """The model's parameter shapes and per-layer bytes (:class:`memfit.planner.sharding.ParamLayout`).

    One decoder layer of each kind is built on ``meta`` and prepared as the trainer prepares it
    (4-bit packing for QLoRA, LoRA adapters), so the bytes are those of the real parameters; each
    is then counted as often as the full model holds its kind. Kept in the memo when ``remember``
    (:mod:`memfit.planner.shortcuts.memo`; not for an exact plan).

    Packed 4-bit weights are kept whole on every rank by memfit's trainer; the hf recipe's FSDP and
    ZeRO-3 shard and gather them as any parameter (:func:`shards_4bit_base`). Either way their
    quantization state (bitsandbytes keeps it beside the parameter, not in it) stays whole.
    """
    key = (
        config_key(config),
        spec.method,
        spec.rank,
        tuple(spec.targets),
        spec.weight_precision,
        spec.dora,
        tuple(spec.modules_to_save),
        shards_4bit_base(spec),
    )
    cached = MEMO.layouts.get(key) if remember else None
    if cached is not None:
        return cached
    from memfit.models.build import DTYPES, build_meta_model, make_config
    from memfit.models.experts_nf4 import unpacked_counts
    from memfit.models.layers import decoder_layers
    from memfit.planner.exact.simulate import _quiet, bitsandbytes_only_if_used
    from memfit.planner.sharding import ParamGroup, ParamLayout
    from memfit.step.prepare import prepare_for_method

    sources, repeats = _layers_to_build(config)
    sampled = len(sources)
    layer_spec = spec.model_copy(update={"checkpointing": "off", "gpus": 1, "shard": "none"})
    with _quiet(), bitsandbytes_only_if_used(layer_spec):
        model = prepare_for_method(
            build_meta_model(make_config(config, layers=sources), DTYPES[spec.weight_precision]), layer_spec
        )
    layers = decoder_layers(model)
    four_bit_experts = unpacked_counts(model)
    in_layer = {}
    for index, layer in enumerate(layers):
        for p in layer.parameters():
            in_layer[id(p)] = index
    groups, layer_bytes, layer_grads = [], [0] * sampled, [0] * sampled
    root_bytes = root_grads = 0
    state_bytes = _quant_state_bytes(model)
    for p in model.parameters():
        nbytes = p.numel() * p.element_size()
        dim0 = int(p.shape[0]) if p.dim() > 0 else 1
        index = in_layer.get(id(p))
        count = repeats[index] if index is not None else 1
        whole = _kept_whole(p, spec, four_bit_experts)
        groups.append(
            ParamGroup(
                dim0=dim0, row_bytes=nbytes // max(dim0, 1), trainable=p.requires_grad, count=count, sharded=not whole
            )
        )
        if id(p) in state_bytes:
            groups.append(ParamGroup(dim0=1, row_bytes=state_bytes[id(p)], trainable=False, count=count, sharded=False))
        if whole:
            continue
        if index is None:
            root_bytes += nbytes
            root_grads += nbytes if p.requires_grad else 0
        else:
            layer_bytes[index] += nbytes
            layer_grads[index] += nbytes if p.requires_grad else 0
    largest = max(range(sampled), key=layer_bytes.__getitem__)
    layout = ParamLayout(
        groups=tuple(groups),
        layer_param_bytes=layer_bytes[largest],
        layer_grad_bytes=layer_grads[largest],
        root_param_bytes=root_bytes,
        root_grad_bytes=root_grads,
    )
    return MEMO.keep("layouts", key, layout) if remember else layout


def shards_4bit_base(spec: RunSpec) -> bool:
    """Whether a rank holds a shard of the packed 4-bit base rather than all of it: the hf recipe's
    QLoRA under FSDP or ZeRO-3 on several GPUs. There the base is stored in a float dtype
    (``bnb_4bit_quant_storage``, which FSDP's and DeepSpeed's guides for QLoRA set) so that FSDP's flat
    parameters and ZeRO-3's partitions take the packed bytes as any other weight: sharded, gathered a
    layer at a time, offloaded with the rest. memfit's trainer keeps them whole on every rank."""
    from memfit.planner.sharding import GATHERING_MODES

    return spec.method == "qlora" and spec.recipe == "hf" and spec.gpus > 1 and spec.shard in GATHERING_MODES


def _kept_whole(p, spec: RunSpec, four_bit_experts: dict) -> bool:
    """Quantized weights every rank keeps whole, outside FSDP and never gathered: int8, 4-bit experts,
    and packed 4-bit weights unless the run shards them (:func:`shards_4bit_base`)."""
    kind = type(p).__name__
    if kind == "Params4bit":
        return not shards_4bit_base(spec)
    return kind == "Int8Params" or id(p) in four_bit_experts


def _quant_state_bytes(model) -> dict[int, int]:
    """Each packed 4-bit weight's quantization state, by the weight's id (absent on ``meta``: counted)."""
    from memfit.models.quantize import is_linear4bit, nf4_quant_state_bytes

    return {
        id(m.weight): nf4_quant_state_bytes(m.in_features * m.out_features) for m in model.modules() if is_linear4bit(m)
    }


def _layers_to_build(config: dict[str, Any]) -> tuple[list[int], list[int]]:
    """The full model's layers to build (one of each kind where the config can cut so, else one
    period of the pattern, else every layer) and how many layers of the full depth each stands for."""
    from memfit.models.layer_kinds import cut_keeps_kinds, layer_pattern

    pattern = layer_pattern(config)
    counts = pattern.counts()
    one_each = [pattern.first(kind) for kind in counts]
    if pattern.coupled:
        return list(range(pattern.num_layers)), [1] * pattern.num_layers
    if len(counts) == 1 or cut_keeps_kinds(config, one_each):
        return one_each, list(counts.values())
    period = pattern.period()
    if pattern.num_layers % period == 0:
        return list(range(period)), [pattern.num_layers // period] * period
    return list(range(pattern.num_layers)), [1] * pattern.num_layers


#: Bytes an optimizer keeps per trainable element at least: AdamW two states in the parameter's
#: dtype (counted from the bytes, see memory_lower_bound); bitsandbytes' 8-bit AdamW two uint8
#: states (plus block absmax), or two fp32 states for tensors too small to quantize: 2 at least.
_STATE_BYTES_PER_ELEMENT_AT_LEAST = {"adamw8bit": 2, "paged-adamw8bit": 2, "sgd": 0}


def memory_lower_bound(
    config: dict[str, Any], spec: RunSpec, context_bytes: int, *, remember: bool = True
) -> int | None:
    """A floor under what any plan of ``spec`` needs: device total plus paged optimizer states.

    Worked out only where it is easy to prove, full fine-tuning on one GPU: every parameter is on
    the device and trained. When the second simulated step's optimizer step starts, every weight,
    every gradient (unless the step runs in backward, which frees each at once) and every optimizer
    state exist together, so the allocated peak is at least their sum, whatever the activations; the
    device total adds the CUDA context to reserved memory, which is at least allocated. Paged states
    are outside the device total but the search counts them beside it, so the sum covers them too.
    Bytes are counted from the parameter layout (:func:`param_layout`, one period of layers on
    ``meta``: cheap), without the 512-byte rounding of allocations, so the floor stays below.
    None where no floor is worked out (LoRA, QLoRA, several GPUs). ``remember``: the layout kept in the memo.
    """
    if spec.method != "full" or spec.gpus != 1 or spec.shard != "none":
        return None
    layout = param_layout(config, spec, remember=remember)
    weights = layout.total_bytes(trainable=True) + layout.total_bytes(trainable=False)
    gradients = 0 if spec.step_in_backward else layout.total_bytes(trainable=True)
    if spec.optimizer == "adamw":
        states = 2 * layout.total_bytes(trainable=True)  # exp_avg and exp_avg_sq, in the parameter's dtype
    else:
        itemsize = {"fp32": 4}.get(spec.weight_precision, 2)
        states = _STATE_BYTES_PER_ELEMENT_AT_LEAST[spec.optimizer] * (layout.total_bytes(trainable=True) // itemsize)
    return weights + gradients + states + context_bytes


def proven_over_budget(
    model: str | dict,
    *,
    revision: str | None = None,
    gpu: str | None = None,
    budget: str | int | None = None,
    target: Target | None = None,
    context_bytes: int | None = None,
    deepspeed: Any = None,
    exact: bool = False,
    **knobs: Any,
) -> bool:
    """True when the plan of these arguments (:func:`memfit.planner.api.plan`'s) cannot fit its GPU,
    budget or ``target``, proven by :func:`memory_lower_bound` without a simulation; False when it may
    fit, or nothing is proven (the floor is worked out for one GPU, where ``deepspeed`` never applies).
    ``exact``: the floor worked out afresh, neither read from nor kept in the plan cache or the memo."""
    from memfit.planner.shortcuts import cache as plan_cache
    from memfit.planner.shortcuts.switch import exact_wanted

    resolved = resolve(model, revision=revision, gpu=gpu, budget=budget, target=target, **knobs)
    if resolved.has_problems or resolved.target.memory_bytes is None:
        return False
    if context_bytes is None:
        context_bytes = resolved.target.context_bytes
    context = runtime_overhead(resolved.target.arch, context_bytes=context_bytes).context_bytes
    # The floor is kept in the plan cache: working it out builds a layer on meta (torch, transformers),
    # which a search answered from the cache would otherwise import for this alone.
    exact = exact_wanted(exact)
    key = (
        plan_cache.make_key(
            "floor",
            {"config": resolved.source.config, "spec": resolved.spec.model_dump(mode="json"), "context_bytes": context},
        )
        if plan_cache.enabled() and not exact
        else None
    )
    stored = plan_cache.load("floor", key)
    if isinstance(stored, dict) and set(stored) == {"bytes"}:
        floor = stored["bytes"]
    else:
        floor = memory_lower_bound(resolved.source.config, resolved.spec, context, remember=not exact)
        plan_cache.store("floor", key, {"bytes": floor})
    return floor is not None and floor > resolved.target.memory_bytes
