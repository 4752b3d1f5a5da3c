"""The plan a user reads: :class:`MemoryPlan`, its JSON forms and its Rich table."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from memfit.json_form import JsonForm
from memfit.planner.categories import CATEGORIES
from memfit.units import format_bytes

CATEGORY_HELP = {
    "weights": "frozen base weights in their storage dtype (incl. 4-bit packed + quant state)",
    "trainable": "trainable parameters (LoRA A/B, or all weights for full fine-tuning)",
    "gradients": "gradients of the trainable parameters",
    "optimizer": "optimizer states",
    "activations": "tensors forward keeps for backward",
    "temporaries": "transient tensors (logits, dequantized weights, recomputation, grads of activations)",
    "allocator": "CUDA caching allocator: reserved but not allocated (rounding, segments, fragmentation)",
    "runtime": "CUDA context and cuBLAS workspaces",
}


def category_help(spec: dict[str, Any], adapters: dict[str, Any] | None, *, reentrant: bool = False) -> dict[str, str]:
    """What each category holds in this plan, where it says more than :data:`CATEGORY_HELP`: what
    trains (LoRA A/B, DoRA's magnitudes, copies of modules trained whole), how the frozen base is
    stored, and the transients and kept tensors DoRA and 8-bit layers add (``reentrant``: the
    checkpointing is torch's reentrant variant, under which 8-bit layers keep nothing of their own)."""
    helps = dict(CATEGORY_HELP)
    if spec["method"] == "full" or adapters is None:
        helps["trainable"] = "every weight (full fine-tuning)"
        return helps
    trained = ["LoRA A/B"]
    if adapters.get("dora"):
        trained.append("DoRA magnitudes (one per output row)")
    for group in adapters.get("trained_copies", []):
        trained.append(
            f"a trainable copy of {' = '.join(group)} (tied: one copy)"
            if len(group) > 1
            else f"a trainable copy of {group[0]}"
        )
    helps["trainable"] = " + ".join(trained)
    base = adapters.get("base")
    stored = {
        "nf4": "NF4-packed linear layers + quant state",
        "int8": "int8 linear layers + an fp32 scale per row",
    }.get(base)
    weights = f"frozen base: {stored}, the rest in its dtype" if stored else f"frozen base weights in {base}"
    if adapters.get("trained_copies"):
        weights += "; the frozen originals of the modules trained whole"
    helps["weights"] = weights
    extra = []
    if adapters.get("dora"):
        extra.append("DoRA: every adapted weight with its update and row norms, each forward (and recomputation)")
    if base == "int8":
        extra.append("int8: inputs quantized, int32 products, the weight dequantized in backward")
        if spec["checkpointing"] != "off" and not reentrant:
            # bitsandbytes keeps them as attributes of its autograd context, where non-reentrant
            # checkpointing's hooks do not see them.
            helps["activations"] = (
                CATEGORY_HELP["activations"] + "; 8-bit layers keep their inputs even under checkpointing"
            )
    if extra:
        helps["temporaries"] = CATEGORY_HELP["temporaries"] + "; " + "; ".join(extra)
    return helps


def with_vision_shares(helps: dict[str, str], vision: dict[str, Any] | None) -> dict[str, str]:
    """``helps`` (:func:`category_help`) with the vision tower's and projector's shares of the weights
    and the activations named, for a vision-language plan (``details.vision``)."""
    if not vision:
        return helps
    helps = dict(helps)
    helps["weights"] += f"; {format_bytes(vision['tower_weight_bytes'])} of them the vision tower's and projector's"
    if vision.get("tower_activation_bytes"):
        helps["activations"] += f"; {format_bytes(vision['tower_activation_bytes'])} of them the vision tower's"
    return helps


def adapter_notes(spec: dict[str, Any], adapters: dict[str, Any] | None) -> list[str]:
    """Plain words on what the adapter options mean for this model (tied copies, LLM.int8's outliers)."""
    if adapters is None:
        return []
    notes = []
    for group in adapters.get("trained_copies", []):
        if len(group) > 1:
            notes.append(
                f"{' and '.join(group)} are one tensor in this model (tied): one trainable copy serves both (PEFT's "
                "ensure_weight_tying), the frozen original stays beside it, and a merge keeps them one tensor"
            )
    if adapters.get("base") == "int8":
        notes.append(
            "LLM.int8's outlier columns (inputs above 6.0, multiplied in 16 bits) are planned as none: each one an 8-bit "
            "layer finds keeps 2 bytes a token of its input until backward"
        )
    return notes


@dataclass
class MemoryPlan(JsonForm):
    """Predicted peak GPU memory of one training step, per GPU.

    ``categories`` are taken at the moment of peak allocated memory, plus the allocator's reserve and
    the runtime; they sum to ``device_total_bytes`` (what ``nvidia-smi`` would show at the peak).
    """

    model: str
    spec: dict[str, Any]
    allocated_bytes: int
    reserved_bytes: int
    device_total_bytes: int
    phase: str
    categories: dict[str, int]
    gpu: dict[str, Any] | None = None
    fits: bool | None = None
    headroom_bytes: int | None = None
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The stable JSON form as a dict (the keys documented in docs/plan.md; scripts rely on them);
        ``to_json(indent=...)`` gives it as JSON text."""
        return {
            "model": self.model,
            "spec": dict(self.spec),
            "peak": {
                "allocated_bytes": int(self.allocated_bytes),
                "reserved_bytes": int(self.reserved_bytes),
                "device_total_bytes": int(self.device_total_bytes),
                "phase": self.phase,
            },
            "categories": {name: int(self.categories[name]) for name in CATEGORIES},
            "gpu": self.gpu,
            "fits": self.fits,
            "headroom_bytes": self.headroom_bytes,
            "details": self.details,
        }

    def render(self, console=None) -> None:
        """Print the plan as Rich tables to ``console`` (by default :func:`memfit.console.make_console`'s:
        the terminal's width, or whole lines in a pipe)."""
        from rich.table import Table

        from memfit.console import make_console
        from memfit.spec import precision_regime_of

        console = console or make_console()
        spec = self.spec
        title = plan_headline(self.model, spec, self.details)
        d = self.details
        if d.get("config"):
            from memfit.interop.summary import headline

            console.print(headline(d["config"]), highlight=False, markup=False, soft_wrap=True)
        # The header is a line of its own, not the table's title: a title wraps at the table's width,
        # and in a pipe or a file (no terminal, no width) the header must stay one line for grep.
        console.print(title, highlight=False)
        # What the precision means (pure or mixed, which format holds what), on a line of its own.
        console.print(
            precision_regime_of(spec),
            highlight=False,
        )
        table = Table(show_footer=True)
        table.add_column("category", footer="device total")
        table.add_column(
            "at peak, per GPU" if self.details.get("per_rank") else "at peak",
            justify="right",
            footer=format_bytes(self.device_total_bytes),
        )
        table.add_column("share", justify="right", footer="100%")
        table.add_column("what it is", style="dim")
        helps = {**CATEGORY_HELP, **d.get("category_help", {})}
        for name in CATEGORIES:
            value = self.categories[name]
            share = value / self.device_total_bytes if self.device_total_bytes else 0.0
            table.add_row(name, format_bytes(value), f"{share:.0%}", helps[name])
        console.print(table)

        peaks = Table.grid(padding=(0, 2))
        peaks.add_row("peak allocated", format_bytes(self.allocated_bytes), "torch.cuda.max_memory_allocated")
        peaks.add_row("peak reserved", format_bytes(self.reserved_bytes), "torch.cuda.max_memory_reserved")
        peaks.add_row(
            "device total", format_bytes(self.device_total_bytes), "what nvidia-smi shows; OOM depends on this"
        )
        peaks.add_row("peak happens in", self.phase, "")

        if d.get("per_rank"):
            states = d["model_state_bytes"]
            peaks.add_row(
                "model states, 1 GPU",
                format_bytes(states["before_bytes"]),
                "weights, gradients, optimizer states unsharded",
            )
            peaks.add_row(
                "model states per GPU",
                format_bytes(states["per_rank_device_bytes"] + states["per_rank_host_bytes"]),
                "in host memory" if states["per_rank_host_bytes"] else f"after --shard {d['shard']}",
            )
        if d.get("host_peak_bytes"):
            peaks.add_row(
                "host memory",
                format_bytes(d["host_peak_bytes"]),
                "pinned CPU memory (offloaded layer inputs, input embeddings, offloaded shards)",
            )
        if d.get("paged_peak_bytes"):
            peaks.add_row(
                "paged optimizer states",
                format_bytes(d["paged_peak_bytes"]),
                "CUDA unified memory: on the GPU while it fits, paged to the host when memory runs short",
            )
        console.print(peaks)
        if "total_params" in d:
            console.print(
                f"parameters: {format_count(d['total_params'])}, trainable {format_count(d['trainable_params'])} "
                f"({100 * d['trainable_params'] / max(d['total_params'], 1):.3f}%)"
            )
        for line in fact_lines(spec, d):
            from rich.markup import escape

            console.print(escape(line), highlight=False)
        if self.gpu is not None:
            name = self.gpu["name"]
            cap = format_bytes(self.gpu["memory_bytes"])
            if self.fits:
                console.print(f"[green]fits[/] {name} ({cap}) with {format_bytes(self.headroom_bytes)} headroom")
            else:
                tips = ", ".join(suggestions(self.spec))
                console.print(
                    f"[red]does not fit[/] {name} ({cap}): {format_bytes(-self.headroom_bytes)} over. Try {tips}."
                )
        for note in d.get("notes", []):
            console.print(f"[dim]note: {note}[/]")
        if d.get("config"):
            from memfit.interop.summary import detail_lines

            for line in detail_lines(d["config"]):
                console.print(line, highlight=False, markup=False, soft_wrap=True)


#: What an exact plan says of itself (memfit.planner.shortcuts.switch).
EXACT_LINE = (
    "made exact: every decoder layer simulated, every chunk and micro-batch run, nothing replayed, "
    "nothing from the plan cache"
)

#: What a preference objective's batch is, said beside it wherever a plan or a search names one.
BATCH_COUNTS_PAIRS = "batch counts pairs"
#: What grpo's batch is, said beside it wherever a plan or a search names one.
BATCH_COUNTS_COMPLETIONS = "batch counts completions"


def objective_words(spec: dict[str, Any]) -> str:
    """The objective as a plan's headline and a search's title name it, with what its batch counts
    ('' for sft)."""
    objective = spec.get("objective", "sft")
    if objective == "grpo":
        return (
            f"grpo ({BATCH_COUNTS_COMPLETIONS}, {spec.get('num_generations')} a prompt, up to "
            f"{spec.get('max_completion_length')} tokens each)"
        )
    return "" if objective == "sft" else f"{objective} ({BATCH_COUNTS_PAIRS})"


def plan_headline(model: str, spec: dict[str, Any], details: dict[str, Any]) -> str:
    """The line a plan starts with, as ``memfit plan`` prints it (Rich markup; ``.plain`` of
    ``rich.text.Text.from_markup`` for the page): the model, the method and its options, the
    precision, optimizer, batch and checkpointing, a preference objective (whose batch counts
    pairs), the hf recipe and the loss it runs, and the GPUs a sharded plan is per GPU of."""
    from rich.markup import escape

    title = (
        f"[bold]{escape(model)}[/] · {spec['method']}"
        + (f" r={spec['rank']}" if spec["method"] != "full" else "")
        + (" DoRA" if spec.get("dora") else "")
        + (" rsLoRA" if spec.get("rslora") else "")
        + (f" + {escape(','.join(spec['modules_to_save']))} trained whole" if spec.get("modules_to_save") else "")
        + f" · {spec['precision']} · {spec['optimizer']} · batch {spec['batch_size']} x {spec['seq_len']} tokens"
        + f" · checkpointing {spec['checkpointing']}"
        + (" (reentrant)" if details.get("reentrant_checkpointing") else "")
        + (f" · [bold]{objective_words(spec)}[/]" if spec.get("objective", "sft") != "sft" else "")
        + (" · [bold]recipe hf[/] (plain Hugging Face + PEFT step)" if spec.get("recipe") == "hf" else "")
        + (f", loss {spec['hf_loss']}" if spec.get("hf_loss", "model") != "model" else "")
    )
    if details.get("per_rank"):
        title += f" · [bold]per GPU[/], {spec['gpus']} GPUs, shard {details['shard']}"
        if spec.get("sequence_parallel", 1) > 1:
            title += f", sequence parallel {spec['sequence_parallel']}"
    return title


def fact_lines(spec: dict[str, Any], details: dict[str, Any]) -> list[str]:
    """The lines ``memfit plan`` prints under its figures, one fact each (plain text): the attention
    the step runs, a hybrid's kinds of layer and its sequence mixers' path, a preference
    objective's reference model (or that it needs none), the memory-lean techniques of the step,
    and that the plan was made exact."""
    lines = phase_lines(details)
    if details.get("exact"):
        lines.append(EXACT_LINE)
    if details.get("attention"):
        lines.append(f"attention: {details['attention']}")
    lines.extend(layer_lines(details))
    lines.extend(expert_lines(details.get("experts")))
    lines.extend(vision_lines(spec, details.get("vision")))
    if details.get("reference"):
        lines.append(f"reference: {details['reference']}")
    features = step_features(spec, details)
    if features:
        lines.append(f"memory-lean step: {', '.join(features)}")
    return lines


#: The width of the longest bar of :func:`phase_lines`.
BAR_WIDTH = 30


def phase_lines(details: dict[str, Any]) -> list[str]:
    """A grpo plan's phases, one bar each (the larger is the plan's peak), what each holds and the
    knobs that drive it; then whether each part was simulated or planned only."""
    phases = details.get("phases") or []
    if not phases:
        return []
    top = max(p["device_total_bytes"] for p in phases) or 1
    lines = []
    for p in phases:
        bar = "█" * max(1, round(BAR_WIDTH * p["device_total_bytes"] / top))
        held = f", KV cache {format_bytes(p['kv_cache_bytes'])}" if p.get("kv_cache_bytes") else ""
        held += f", vLLM {format_bytes(p['vllm_bytes'])}" if p.get("vllm_bytes") else ""
        mark = " <- peak" if p["device_total_bytes"] == top else ""
        lines.append(
            f"{p['name']:<10} {bar:<{BAR_WIDTH}} {format_bytes(p['device_total_bytes'])}{mark} ({p['phase']}{held}; "
            f"{p['planned']}; driven by {', '.join(p['drivers'])})"
        )
    return lines


def layer_lines(details: dict[str, Any]) -> list[str]:
    """The report's lines on a hybrid's kinds of layer and on how its sequence mixers run."""
    lines = []
    kinds = details.get("layer_kinds") or []
    if len(kinds) > 1:
        counted = ", ".join(f"{k['layers']} {k['kind']}" for k in kinds)
        simulated = ", ".join(str(n) for n in details.get("simulated_layers", []))
        lines.append(f"decoder layers: {counted} (simulated {simulated} layers, each kind counted by its number)")
    mixers = details.get("sequence_mixers")
    if mixers:
        missing = [p for p in mixers["packages"] if p not in mixers["installed"]]
        why = (
            f"{', '.join(missing)} not installed"
            if not mixers["installed"]
            else f"the run calls {', '.join(mixers['installed'])}'s kernels"
        )
        lines.append(f"sequence mixers: simulated on transformers' PyTorch path ({why})")
    return lines


def vision_lines(spec: dict[str, Any], vision: dict[str, Any] | None) -> list[str]:
    """The report's lines on a vision-language model (``details.vision``): its vision tower and
    projector, whether they train, and the images each example holds with their tokens."""
    if not vision:
        return []
    trained = "trained" if spec.get("freeze_vision") is False else "frozen"
    checkpointing = spec.get("vision_checkpointing")
    height, width = vision["image_size"]
    return [
        f"vision tower: {vision['tower_blocks']} blocks, {format_count(vision['tower_params'])} parameters, projector "
        f"{format_count(vision['projector_params'])}, {format_bytes(vision['tower_weight_bytes'])} of weights"
        + (
            f", {format_bytes(vision['tower_activation_bytes'])} of activations"
            if vision.get("tower_activation_bytes")
            else ""
        )
        + f", {trained}"
        + (f", checkpointing {checkpointing}" if checkpointing else ""),
        f"images: {vision['images']} an example, up to {height}x{width} pixels "
        f"(image_max_pixels {vision['image_max_pixels']:,}), {vision['tokens_per_image']:,} tokens each",
    ]


def expert_lines(experts: dict[str, Any] | None) -> list[str]:
    """The report's lines on a mixture-of-experts model (``details.experts``): its parameters and
    their storage, the tokens each expert gets, the routing loss, LoRA on the experts."""
    if not experts:
        return []
    stored = {"nf4": "NF4"}.get(experts["storage"], experts["storage"])
    lines = [
        f"experts: {experts['moe_layers']} layers of {experts['experts_per_layer']}, top {experts['top_k']} a token: "
        f"{format_count(experts['total_params'])} parameters, {format_count(experts['active_params'])} active a token "
        f"({experts['experts_share']:.0%} of them in experts, stored in {stored}); {experts['forward']}",
        f"routing: {experts['tokens_per_micro_batch']:,} tokens a micro-batch, {experts['tokens_per_expert']:,} an expert when "
        "routing is balanced; an imbalanced batch adds no memory (every routed token's row is in one tensor however they spread)",
    ]
    aux = experts.get("router_aux_loss")
    if aux:
        if aux["on"]:
            state = "added to the loss, the router logits of every MoE layer kept for it"
        elif aux.get("asked"):
            state = "output_router_logits is on, and the preference objectives' losses leave it out"
        else:
            state = "off (output_router_logits: false; set it in model_overrides to train with it)"
        lines.append(f"routing loss: router_aux_loss_coef {aux['coef']:g}, {state}")
    adapters = experts.get("adapters")
    if adapters and adapters["weights"]:
        lines.append(
            f"LoRA on experts: {', '.join(adapters['weights'])}, {format_count(adapters['trainable_params'])} trainable "
            f"(each expert its own pair): {_state_bytes(adapters['bytes'])}; the adapters on the rest: "
            f"{format_count(adapters['rest']['trainable_params'])} trainable, {_state_bytes(adapters['rest']['bytes'])}"
        )
    return lines


def _state_bytes(counts: dict[str, int]) -> str:
    """Trainable parameters' bytes, as a plan's adapters line says them (whole model, before any sharding)."""
    return (
        f"{format_bytes(sum(counts.values()))} ({format_bytes(counts['weights'])} weights, "
        f"{format_bytes(counts['gradients'])} gradients, {format_bytes(counts['optimizer'])} optimizer states)"
    )


def step_features(spec: dict[str, Any], details: dict[str, Any] | None = None) -> list[str]:
    """The memory-lean techniques of memfit's step that this plan includes (none for ``recipe hf``)."""
    from memfit.spec import ADAPTER_METHODS, tiles_sequence

    recipe = spec.get("recipe", "memfit")
    if recipe == "hf":
        return []
    objective = spec.get("objective", "sft")
    features = [
        "fused chunked loss"
        if objective == "sft"
        else "fused chunked per-token log-probs of the completions"
        if objective == "grpo"
        else "fused chunked log-probs, chosen and rejected in one forward"
    ]
    if (details or {}).get("batch_layout") == "documents":
        features.append("padding-free batches (attention inside each example)")
    if tiles_sequence(spec.get("tiling", "auto"), recipe, spec["batch_size"] * spec["seq_len"]):
        features.append("tiled MLP and norms")
    if spec["checkpointing"] == "offload":
        features.append("offloaded checkpointing with prefetch")
    if spec["method"] in ADAPTER_METHODS and not spec.get("dora"):  # DoRA layers keep PEFT's fp32 input
        features.append("LoRA inputs kept in the compute dtype")
    if spec.get("step_in_backward"):
        features.append("optimizer step in backward")
    if (details or {}).get("input_embeddings") == "host":
        features.append("frozen input embeddings in host memory")
    return features


def suggestions(spec: dict[str, Any]) -> list[str]:
    """Knob changes that lower peak memory, for a spec that does not fit (only ones not already set)."""
    tips = []
    if spec["checkpointing"] == "off":
        tips.append("--checkpointing on")
    elif spec["checkpointing"] == "on":
        tips.append("--checkpointing offload")
    if spec["batch_size"] > 1:
        tips.append(f"--batch-size {spec['batch_size'] // 2} with --grad-accum {spec['grad_accum'] * 2}")
    if spec["method"] == "full":
        tips.append("--method lora")
    elif spec["method"] == "lora":
        tips.append("--method qlora")
    if spec["method"] == "full" and spec["precision"] in ("bf16-mixed", "fp16-mixed"):
        tips.append("--precision bf16 (pure bf16: half the bytes of fp32 weights, gradients and optimizer states)")
    if spec["method"] == "full" and spec["optimizer"] == "adamw":
        tips.append("--optimizer adamw8bit")
    if spec["method"] == "full" and spec["grad_accum"] == 1 and not spec.get("step_in_backward"):
        tips.append("--step-in-backward --max-grad-norm none")
    if spec.get("tiling") == "off":
        tips.append("--tiling on")
    tips.append(f"a shorter --seq-len than {spec['seq_len']}")
    return tips


def format_count(n: int) -> str:
    """A parameter count for people: 8.030 B, 41.94 M, 45,056."""
    if n >= 1e9:
        return f"{n / 1e9:.3f} B"
    if n >= 1e6:
        return f"{n / 1e6:.2f} M"
    return f"{n:,}"
