"""The page's form, described from the declarations it shows: RunSpec's knobs and the catalogs.

The page draws its inputs from :func:`form` (``GET /api/form``): one entry per knob with its kind,
choices, default and help, in RunSpec's order, so that a knob added to :mod:`memfit.spec` appears
on the page without a change to the page; the model and GPU catalogs for completion; and the
options ``memfit fit`` takes, so the page sends a search only what the command line would.
"""

from __future__ import annotations

from typing import Any

from memfit.spec import KNOBS, TRAINED_KNOBS, choices, default, flag, help_text, value_kind

#: Knobs shown first, as most people size a run (the rest follow in RunSpec's order, folded).
MAIN_KNOBS = ("method", "rank", "seq_len", "batch_size", "grad_accum", "checkpointing", "optimizer", "precision")


def knob_fields() -> list[dict[str, Any]]:
    """Every RunSpec knob as a form field: name, flag, kind, choices, default, help, main or not."""
    order = [k for k in MAIN_KNOBS if k in KNOBS] + [k for k in KNOBS if k not in MAIN_KNOBS]
    fields = []
    for name in order:
        declared = default(name)
        if isinstance(declared, tuple):
            declared = ",".join(declared)
        fields.append(
            {
                "name": name,
                "flag": flag(name),
                "kind": value_kind(name),
                "choices": list(choices(name)),
                "default": declared,
                "help": help_text(name),
                "main": name in MAIN_KNOBS,
                "trained": name in TRAINED_KNOBS,
            }
        )
    return fields


def catalogs() -> dict[str, Any]:
    """The model and GPU catalogs (``memfit models --json``'s content) for the page's completion."""
    from memfit.models.catalog import catalog_names, load_catalog_config
    from memfit.models.gpus import load_gpus

    models = []
    for name in catalog_names():
        config = load_catalog_config(name)
        models.append(
            {
                "name": name,
                "model_type": config.get("model_type"),
                "layers": config.get("num_hidden_layers"),
                "hidden_size": config.get("hidden_size"),
                "max_position_embeddings": config.get("max_position_embeddings"),
            }
        )
    gpus = [
        {
            "name": g.name,
            "display_name": g.display_name,
            "memory_bytes": g.memory_bytes,
            "arch": g.arch,
            "supports_bf16": g.supports_bf16,
        }
        for g in load_gpus().values()
    ]
    return {"models": models, "gpus": gpus}


def form() -> dict[str, Any]:
    """Everything the page needs to draw its inputs."""
    from memfit.planner.report import CATEGORY_HELP
    from memfit.ui.params import DEFAULT_MODEL, FIT_KNOBS, FIT_OPTIONS

    return {
        "knobs": knob_fields(),
        "default_model": DEFAULT_MODEL,
        "fit_knobs": list(FIT_KNOBS),
        "fit_options": list(FIT_OPTIONS),
        "category_help": dict(CATEGORY_HELP),
        **catalogs(),
    }
