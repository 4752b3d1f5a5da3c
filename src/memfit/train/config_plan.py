"""``memfit plan`` and ``memfit fit`` of memfit's own training config: the run the YAML describes.

The YAML ``memfit train`` takes is the first config a user has. It is told apart from other tools'
configs by its keys (:func:`is_train_config`), read as ``memfit train`` reads it (:func:`load_config`,
the command line's options on top), and planned as the trainer's preflight plans it before loading
(:mod:`memfit.train.preflight`): the model's config with ``model_overrides``, the run's knobs, and the
length the data makes (:func:`memfit.train.fitting.planned_seq_len`: the longest micro-batch of its
examples, at most ``seq_len``) when the data is at hand: local files, read whole, and a tokenizer
on this machine. Otherwise the plan is at ``seq_len`` and says why. ``memfit fit`` searches the
split of the effective batch, checkpointing and tiling (and the optimizer with ``fit_optimizer``) at
the data's longest example, as ``fit: auto`` does; ``fit --write`` writes the same YAML back with
only those keys changed (:func:`write_fitted_train_config`).

This lives with the trainer, which owns the config and the data (the planner knows neither).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memfit.planner.search.request import FitEvents, FitRequest
from memfit.planner.search.results import FitResult
from memfit.planner.search.run import SEARCHED
from memfit.train.config import TrainConfig, load_config, tokenizer_path

#: Knobs ``fit --write`` may change in the YAML (the search's), in the order they are written.
WRITTEN = ("method", "batch_size", "grad_accum", "checkpointing", "tiling", "optimizer")


def is_train_config(model: Any) -> bool:
    """Whether ``model`` names a YAML of memfit's own training config: a mapping that names its model
    with ``model`` (memfit's key, no other tool's: :func:`memfit.interop.is_memfit_config`)."""
    if not isinstance(model, (str, Path)):
        return False
    path = Path(model).expanduser()
    if path.suffix.lower() not in (".yaml", ".yml") or not path.is_file():
        return False
    import yaml

    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return False  # reading it as another tool's config says what is wrong with it
    from memfit.interop import is_memfit_config

    return is_memfit_config(raw)


@dataclass
class ConfigRun:
    """A training config read for planning: the config, its model's config dict, the lengths."""

    config: TrainConfig
    path: str
    model: dict[str, Any]  # config.json with model_overrides, named as the model was named
    note: str | None  # how the model's config was obtained, when worth saying (a shipped copy)
    given: dict[str, Any]  # the command line's knobs
    model_given: bool = False  # --model replaced the config's model
    replaced: str | None = None  # the config's model, as written, where --model replaced it
    examples: list = field(default_factory=list)  # the data's training examples, when read
    layout: str = ""  # the step's batch layout (padded rows or documents in one row)
    unread: str | None = None  # why the data was not read

    def seq_len_for(self, batch_size: int) -> int:
        """The length the trainer plans a micro-batch of ``batch_size`` at (:func:`planned_seq_len`)."""
        from memfit.train.fitting import planned_seq_len

        if not self.examples or self.config.spec.is_grpo:  # grpo: completions are generated, the longest planned
            return self.config.seq_len
        return planned_seq_len(self.examples, batch_size, self.config.seq_len, self.layout, self.config.packing)

    def details(self, planned: int, what: str) -> dict[str, Any]:
        """``details.config`` of a plan or a fit of this config (:mod:`memfit.interop.summary` says it)."""
        config = self.config
        return {
            "tool": "memfit",
            "title": "memfit training",
            "path": self.path,
            "model": self.model["_name_or_path"],
            "revision": config.revision,
            "knobs": config.knobs(),
            "given": {k: getattr(config, k) for k in self.given},
            "given_model": self.model_given,
            "replaced": self.replaced,
            "model_overrides": dict(config.model_overrides),
            "data": {
                "read": not self.unread,
                "why_not": self.unread,
                "examples": len(self.examples),
                "seq_len": config.seq_len,
                "planned_seq_len": planned,
                "planned_as": what,
            },
            "not_modelled": [],
            "approximated": [],
            "unknown_keys": [],
        }


def read_config_run(
    path: str | Path, *, model_override: str | None = None, revision: str | None = None, **knobs: Any
) -> ConfigRun:
    """Read the training config at ``path`` as ``memfit train`` does, with ``knobs`` (the command
    line's) on top and ``model_override`` (``--model``) in place of its model; its model checked
    against it (:func:`memfit.train.preflight.check_model`); its data read when at hand."""
    from memfit.models.catalog import resolve_model
    from memfit.train.preflight import check_model

    given = {k: v for k, v in knobs.items() if v is not None}
    overrides = dict(given, **({"revision": revision} if revision else {}))
    if model_override:
        overrides["model"] = model_override
    config = load_config(path, overrides)
    replaced = _configured_model(path) if model_override else None
    source = resolve_model(config.model, revision=config.revision)
    model = dict(source.config, **config.model_overrides, _name_or_path=source.name)  # model_config_dict, with the name
    check_model(config, model)
    run = ConfigRun(config, str(path), model, source.note, given, bool(model_override), replaced)
    run.unread = _unread(config)
    if run.unread is None:
        _read_data(run)
    return run


def _configured_model(path: str | Path) -> str | None:
    """The model the YAML at ``path`` names, as written."""
    import yaml

    raw = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    return str(raw.get("model")) if isinstance(raw, dict) and raw.get("model") is not None else None


def _unread(config: TrainConfig) -> str | None:
    """Why the data is not at hand for a plan (None when it is): it is a stream, a Hub dataset (plans
    fetch nothing but a model's config.json), or its tokenizer is not on this machine."""
    from memfit.train.data.sources import as_sources

    if config.streaming:
        return "streaming: a stream's longest example is not known before it is read"
    remote = [s.label() for s in as_sources(config.data) if not Path(s.path).expanduser().exists()]
    if remote:
        return f"{', '.join(remote)} is not a local file or folder (a plan fetches no data)"
    tokenizer = tokenizer_path(config)
    if not Path(tokenizer).expanduser().exists():
        return (
            f"the tokenizer ({tokenizer}) is not on this machine (a plan fetches nothing but the model's config.json)"
        )
    return None


def _read_data(run: ConfigRun) -> None:
    """The data's training examples, tokenized as the trainer tokenizes them, and the step's batch
    layout (which decides how a micro-batch's length is counted)."""
    from memfit.models.build import make_config
    from memfit.step.builder import build_step
    from memfit.train.examples import load_run_processor, load_tokenizer, prepare_data

    config = run.config
    processor = load_run_processor(config)  # a vision-language model's records go through its processor
    tokenizer = processor.tokenizer if processor is not None else load_tokenizer(config)
    # The evaluation data decides nothing of a training step: not read.
    data = prepare_data(config.model_copy(update={"eval_data": None}), tokenizer, processor=processor)
    run.examples = data.train_examples
    model = {k: v for k, v in run.model.items() if k != "_name_or_path"}
    run.layout = build_step(config.spec, make_config(model), config.objective_params).layout


def plan_train_config(
    path: str | Path,
    *,
    model_override: str | None = None,
    revision: str | None = None,
    gpu: str | None = None,
    budget: str | None = None,
    **options: Any,
):
    """The plan of the run the training config at ``path`` describes, as its preflight plans it: at
    the data's longest micro-batch when the data is at hand. ``options``: the command line's knobs
    and :func:`memfit.planner.api.plan`'s own (``context_bytes``, ``exact``, ``cache``)."""
    from memfit.planner.api import plan

    own = {k: options.pop(k) for k in ("context_bytes", "exact", "cache") if k in options}
    planner_only = _planner_only(options)
    run = read_config_run(path, model_override=model_override, revision=revision, **options)
    config = run.config
    seq_len = run.seq_len_for(config.batch_size)
    result = plan(
        run.model,
        gpu=gpu or config.gpu,
        budget=budget or config.budget,
        **own,
        **dict(config.knobs(), seq_len=seq_len, **planner_only),
    )
    what = "the data's longest micro-batch" if run.examples else "seq_len"
    result.details = dict(result.details, config=run.details(seq_len, what))
    result.details["config"]["given"].update(planner_only)
    if run.note:
        result.details["notes"] = [run.note] + list(result.details.get("notes", []))
    return result


def fit_train_config(request: FitRequest, events: FitEvents | None = None) -> FitResult:
    """``memfit fit`` of the training config ``request.model`` names: its method (unless
    ``request.methods``), effective batch and other knobs kept (the request's knobs on top); the
    split of the batch, checkpointing and tiling searched (and the optimizer, with its
    ``fit_optimizer``) at the data's longest example, as ``fit: auto`` searches."""
    from memfit.planner.search.driver import fit

    given = dict(request.knobs, **({"gpus": request.gpus} if request.gpus is not None else {}))
    planner_only = _planner_only(given)
    run = read_config_run(
        request.model,
        model_override=request.model_override,
        revision=request.revision,
        seq_len=request.seq_len,
        **given,
    )
    config = run.config
    longest = run.seq_len_for(1)  # no micro-batch of the data has longer examples, on average, than its longest one
    fixed = {k: v for k, v in config.knobs().items() if k not in SEARCHED and k not in ("method", "seq_len")}
    fixed.update(planner_only)
    kept = None if config.fit_optimizer else {m: (config.optimizer,) for m in ("full", "lora", "qlora", "lora-8bit")}
    search = dataclasses.replace(
        request,
        model=run.model,
        model_override=None,
        revision=None,
        gpu=request.gpu or config.gpu,
        budget=request.budget or config.budget,
        seq_len=longest,
        methods=request.methods or (config.method,),
        batch_size=config.batch_size * config.grad_accum if request.batch_size is None else request.batch_size,
        gpus=fixed.pop("gpus", None),
        knobs=fixed,
        optimizers=kept,
    )
    result = fit(search, events)
    result.config = run.details(longest, "the data's longest example" if run.examples else "seq_len")
    result.config["given"].update(planner_only)
    if run.note:
        result.notes = [run.note] + list(result.notes)
    return result


def _planner_only(options: dict[str, Any]) -> dict[str, Any]:
    """Take the knobs the planner has and the training config has not (``--recipe hf``: the plain
    Hugging Face step, for comparison) out of ``options``: they go to the plan, not the config."""
    from memfit.spec import KNOBS, TRAINED_KNOBS

    names = [k for k in options if k in KNOBS and k not in TRAINED_KNOBS]
    return {k: v for k in names if (v := options.pop(k)) is not None}


def write_fitted_train_config(
    path: str | Path, spec: dict[str, Any], out: str | Path, *, overwrite: bool = False
) -> str:
    """Write the training config at ``path`` to ``out`` with the keys the fit chose (:data:`WRITTEN`)
    changed where they differ from the config's, comments and order kept; return the unified diff."""
    from memfit.interop.writing import write_changes
    from memfit.spec import tiles_sequence

    config = load_config(path)
    changes = {}
    for knob in WRITTEN:
        ours, chosen = getattr(config, knob), spec[knob]
        if knob == "tiling":  # "auto" that resolves to the same is left as it is
            tokens = spec["batch_size"] * config.seq_len
            if tiles_sequence(ours, "memfit", tokens) == tiles_sequence(chosen, "memfit", tokens):
                continue
        if ours != chosen:
            changes[knob] = chosen
    return write_changes(path, changes, out, overwrite=overwrite, spelled=_spelled(path))


def _spelled(path: str | Path) -> dict[str, str]:
    """How the YAML spells each key it has (``grad-accum`` for ``grad_accum``), so that a change lands on it."""
    import yaml

    raw = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    return {str(k).replace("-", "_"): str(k) for k in raw} if isinstance(raw, dict) else {}
