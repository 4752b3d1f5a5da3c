"""Rules more than one tool's key map uses: the model, a module list, a number with the tool's default."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from memfit.interop.keys import ABSENT, KeyProblem, Planned, Rule, as_bool, as_int, as_names, value_of


def model_rule(*names: str, doc: str = "") -> Rule:
    """The model: the first of ``names`` set (a Hub id, or a folder: relative to the config, then
    to the working directory, as the tool started from there would find it)."""

    def resolve(values: Mapping[str, Any], ctx: Any) -> Any:
        for name in names:
            value = values[name]
            if value is ABSENT or value is None or (isinstance(value, str) and not value.strip()):
                continue
            if not isinstance(value, str):
                raise KeyProblem(
                    name, f"{value!r} is not a model name (a Hub id such as meta-llama/Llama-3.1-8B, or a folder)"
                )
            text = value.strip()
            for candidate in (ctx.folder / text, Path.cwd() / text):
                if not Path(text).is_absolute() and candidate.exists():
                    return str(candidate.resolve())
            return text
        return None

    return Rule(
        tuple(names),
        "model",
        resolve,
        doc=doc or "the model to plan: a Hub id (its config.json is fetched) or a folder",
    )


def revision_rule(name: str) -> Rule:
    def resolve(values: Mapping[str, Any], ctx: Any) -> Any:
        value = values[name]
        return None if value is ABSENT or value in (None, "", "main") else str(value)

    return Rule((name,), "revision", resolve, doc="the Hub revision (branch, tag or commit) of the model's config.json")


def int_rule(name: str, knob: str, default: Any = ABSENT, *, doc: str, write: bool = True) -> Rule:
    """Whole-number key ``name`` (the tool's ``default`` when absent) for knob ``knob``."""

    def resolve(values: Mapping[str, Any], ctx: Any) -> Any:
        value = value_of(values, name, as_int, default)
        return None if value is ABSENT else value

    return Rule((name,), knob, resolve, (lambda v, values: {name: int(v)}) if write else None, doc=doc)


def targets_rule(
    all_linear: str | None, modules: str, *, all_words: tuple[str, ...] = ("all", "all-linear", "all_linear"), doc: str
) -> Rule:
    """LoRA targets: ``all_linear`` (a true/false key, if the tool has one) or the module list
    ``modules`` (a list or comma-separated names; ``all_words`` there mean every linear layer)."""
    keys = (all_linear, modules) if all_linear else (modules,)

    def resolve(values: Mapping[str, Any], ctx: Any) -> Any:
        from memfit.interop.keys import as_bool
        from memfit.spec import ALL_LINEAR

        if all_linear and value_of(values, all_linear, as_bool, False):
            return (ALL_LINEAR,)  # every linear layer of the decoder; named modules too are among them
        names = value_of(values, modules, as_names, None)
        if names is None:
            return None
        if len(names) == 1 and names[0].lower() in all_words:
            return (ALL_LINEAR,)
        return names

    return Rule(keys, "targets", resolve, doc=doc)


def bool_rule(name: str, knob: str, *, doc: str) -> Rule:
    """true / false key ``name`` for knob ``knob`` (absent: the knob's default)."""
    return Rule((name,), knob, lambda values, ctx: value_of(values, name, as_bool, None), doc=doc)


def dora_rule(name: str) -> Rule:
    """DoRA on or off from the tool's key ``name`` (PEFT's ``use_dora``)."""
    return bool_rule(
        name, "dora", doc="DoRA: a magnitude per output row, and the norm of every adapted weight each forward"
    )


def rslora_rule(name: str) -> Rule:
    """rsLoRA on or off from the tool's key ``name`` (PEFT's ``use_rslora``)."""
    return bool_rule(name, "rslora", doc="rsLoRA: the update scaled by alpha / sqrt(rank) (no change in memory)")


#: What a tool's modules_to_save key means, for the tools without a key for weight tying.
MODULES_TO_SAVE_DOC = (
    "modules trained whole besides the adapters (PEFT's modules_to_save): trainable copies, with their "
    "gradients and optimizer states; a tied embedding and head named both: planned as one shared copy "
    "(PEFT trains two, listed)"
)


def modules_to_save_rule(name: str, tying: str | None = None, *, doc: str = MODULES_TO_SAVE_DOC) -> Rule:
    """Modules trained whole (``modules_to_save``) from key ``name`` (a list, or comma-separated
    names; empty or null: none). ``tying``: the tool's key for PEFT's ``ensure_weight_tying``.

    memfit trains one copy for an embedding and head that are one tensor (tied) and keeps them one;
    PEFT without ``ensure_weight_tying`` trains a copy of each. Which models are tied is not known
    from the config: naming both is listed as an approximation."""
    keys = (name, tying) if tying else (name,)

    def resolve(values: Mapping[str, Any], ctx: Any) -> Any:
        value = values[name]
        if value is ABSENT or value is None or value == [] or (isinstance(value, str) and not value.strip()):
            return None
        names = value_of(values, name, as_names, None)
        tied = bool(tying) and value_of(values, tying, as_bool, False)
        both = all(any(n == m or n.endswith("." + m) for n in names) for m in ("embed_tokens", "lm_head"))
        if both and not tied:
            why = (
                "on a model whose embeddings and head are tied (tie_word_embeddings), PEFT without ensure_weight_tying "
                "trains a copy of each: planned as one shared copy, as memfit trains them"
            )
            return Planned(names, why + (f" (as with {tying}: true)" if tying else ""), modelled=True)
        return names

    return Rule(keys, "modules_to_save", resolve, doc=doc)


#: The model config fields of a mixture-of-experts model's routing loss, which tools set as they load
#: the model: router logits on (the load-balancing loss added to the loss) and its coefficient.
ROUTING_FIELDS = ("output_router_logits", "router_aux_loss_coef")

#: What memfit does with a tool's routing-loss setting, in docs/interop.md.
ROUTING_DOC = (
    "the routing loss of a mixture-of-experts model (output_router_logits, router_aux_loss_coef): set in the "
    "planned model's config, whose step adds the load-balancing loss and keeps the router logits for it"
)


def routing_rule(name: str) -> Rule:
    """The routing-loss fields of the model config the tool's dict key ``name`` overrides (Axolotl's
    ``overrides_of_model_config``, TRL's ``model_init_kwargs``); its other fields are the other
    rules' (or not modelled)."""

    def resolve(values: Mapping[str, Any], ctx: Any) -> Any:
        value = values[name]
        if not isinstance(value, Mapping):
            return None
        found = {field: value[field] for field in ROUTING_FIELDS if field in value}
        return _routing(found, name) or None

    return Rule((name,), "model_config", resolve, doc=ROUTING_DOC)


def _routing(found: Mapping[str, Any], key: str) -> dict[str, Any]:
    out = {}
    if "output_router_logits" in found:
        out["output_router_logits"] = value_of({key: found["output_router_logits"]}, key, as_bool, False)
    if "router_aux_loss_coef" in found:
        coef = found["router_aux_loss_coef"]
        if isinstance(coef, bool) or not isinstance(coef, (int, float)) or coef < 0:
            raise KeyProblem(key, f"router_aux_loss_coef {coef!r} is not a coefficient (a number of 0 or more)")
        out["router_aux_loss_coef"] = float(coef)
    return out


def use_reentrant_of(kwargs: Any, key: str) -> str | None:
    """The ``use_reentrant`` of a ``gradient_checkpointing_kwargs`` mapping as the ``use_reentrant`` knob's
    on / off; None where the mapping (or its absence) leaves the variant to the tool's default."""
    if kwargs is ABSENT or kwargs is None:
        return None
    if not isinstance(kwargs, Mapping):
        raise KeyProblem(key, f"{kwargs!r} is not a mapping of checkpoint arguments (e.g. {{use_reentrant: false}})")
    said = kwargs.get("use_reentrant")
    if said is None:
        return None
    try:
        return "on" if as_bool(said) else "off"
    except ValueError:
        raise KeyProblem(key, f"use_reentrant: {said!r} is not true or false") from None
