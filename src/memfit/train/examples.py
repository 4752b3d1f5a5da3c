"""The run's data, made ready before any weight is read: tokenizer, examples, the evaluation split.

Everything that can fail on the user's data fails here, first (a bad file, a Hub dataset that does
not exist or lacks the split, a column the mapping names, a tokenizer that does not match the
model), so that no model is loaded for a run that cannot start. A stream's first rows are checked
here; the rest is read while the run trains.
"""

from __future__ import annotations

import json
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from memfit.train.config import TrainConfig, tokenizer_path
from memfit.train.errors import TrainError


def seed_everything(seed: int) -> None:
    """Seed python, numpy (when loaded) and torch (CPU and every CUDA device)."""
    random.seed(seed)
    if "numpy" in sys.modules:
        import numpy as np

        np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def load_tokenizer(config: TrainConfig):
    """The run's tokenizer (see :func:`memfit.train.config.tokenizer_path`)."""
    from transformers import AutoTokenizer

    path = tokenizer_path(config)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as err:
        raise TrainError(f"tokenizer: cannot load a tokenizer from {str(path)!r}: {err}") from None
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is None:
        raise TrainError(f"tokenizer: {path} has neither a pad nor an EOS token; training batches need padding")
    return tokenizer


def load_run_processor(config: TrainConfig):
    """A vision-language run's processor (:mod:`memfit.train.processor`): the model's own, read from
    ``tokenizer`` or the pretrained model's folder, or one built for a random tiny model; None for a
    text model."""
    from memfit.models.build import make_config
    from memfit.models.vision import is_vision_config
    from memfit.train.config import model_config_dict
    from memfit.train.processor import load_processor

    model_dict = model_config_dict(config)
    if not is_vision_config(model_dict):
        return None
    given = config.tokenizer or (config.model if config.init == "pretrained" else None)
    return load_processor(given, make_config(model_dict))


def pad_token_id(tokenizer) -> int:
    """The id batches are padded with: the pad token, or EOS when the tokenizer has none."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


@dataclass
class RunData:
    """The run's training and evaluation examples, or its training stream.

    ``train_examples`` is empty for a stream: the run plans at ``seq_len`` (a stream's longest
    example is not known before it is read). ``record`` is what ``run.json`` keeps of the data.
    """

    train_examples: list
    eval_examples: list
    stream: Any = None  # memfit.train.data.reading.Stream
    record: dict[str, Any] = field(default_factory=dict)
    pair_stats: Any = None  # memfit.train.data.pairs.PairStats: what seq_len cut of a preference run's pairs
    prompt_stats: Any = None  # memfit.train.data.prompts.PromptStats: a grpo run's prompts

    @property
    def checked_examples(self) -> list:
        """The examples known now (a stream's: those of its first rows), to check against the model."""
        sample = self.stream.examples if self.stream is not None else self.train_examples
        return list(sample) + list(self.eval_examples)

    def batches(self, batch_size: int, config: TrainConfig, eos_id: int | None = None):
        """The run's batch order: a BatchIterator over the examples, or the stream's batches."""
        from memfit.train.data import BatchIterator

        if self.stream is None:
            return BatchIterator(self.train_examples, batch_size=batch_size, seed=config.seed)
        from memfit.train.data.tokenization import Packer

        packer = Packer(config.seq_len, eos_id) if config.packing else None
        return self.stream.batches(
            batch_size, seed=config.seed, shuffle_buffer_size=config.shuffle_buffer_size, packer=packer
        )


def prepare_data(
    config: TrainConfig, tokenizer, *, console=None, resume_from: Path | None = None, processor=None
) -> RunData:
    """Load, validate and tokenize the training data (or open its stream and check its first rows);
    split off (or load) the evaluation set. A vision-language run's records are tokenized by its
    ``processor`` (:mod:`memfit.train.data.vision`), their images read and checked now.

    ``resume_from``: the folder of a run being resumed; its Hub datasets are read at the commits it
    recorded, so the resumed run reads the same rows. A preference objective (dpo, orpo, simpo)
    reads pairs through the same sources (:func:`_prepare_pairs`).
    """
    from memfit.train.data.reading import load_sources, open_stream
    from memfit.train.data.sources import as_sources
    from memfit.train.data.tokenization import check_tokenization, tokenize_record, tokenize_records

    sources, eval_sources = as_sources(config.data), as_sources(config.eval_data)
    pinned = recorded_commits(resume_from) if resume_from is not None else {}
    eval_records: list = []
    if eval_sources:
        eval_loaded = load_sources(
            eval_sources, "eval_data", format=config.data_format, commits=_pins(eval_sources, pinned.get("eval_data"))
        )
        eval_records = eval_loaded.records
        _say_notes(console, eval_loaded.notes)
    common = dict(
        format=config.data_format,
        seed=config.seed,
        stopping_strategy=config.stopping_strategy,
        commits=_pins(sources, pinned.get("data")),
    )
    kwargs = dict(seq_len=config.seq_len, train_on_inputs=config.train_on_inputs, packing=config.packing)
    if processor is not None:
        tokenize_records, tokenize_record = _vision_tokenizers(config, processor)
    if config.spec.is_preference:
        return _prepare_pairs(
            config, tokenizer, sources, eval_sources, common, eval_loaded if eval_sources else None, console
        )
    if config.spec.is_grpo:
        return _prepare_prompts(config, tokenizer, sources, {**common, "format": "prompt"}, console)
    if eval_sources:
        refuse_other_kinds(config, "eval_data", eval_sources, eval_loaded.formats)
    eval_examples = tokenize_records(eval_records, tokenizer, **kwargs) if eval_records else []
    if config.streaming:
        check_tokenization(tokenizer, config.seq_len)

        def tokenize(record):
            if "pair" in record:  # a pairs source: refused below, once every source's format is known
                return None
            return tokenize_record(record, tokenizer, config.seq_len, config.train_on_inputs)

        stream = open_stream(sources, "data", tokenize=tokenize, **common)
        refuse_other_kinds(config, "data", sources, stream.formats)
        _say_notes(console, stream.notes)
        if console is not None:
            console.print(
                f"streaming {_names(sources)}: planned at seq_len {config.seq_len} (a stream's longest example is "
                "not known before it is read)",
                highlight=False,
            )
        record = _data_record(sources, stream.commits, eval_sources, eval_loaded.commits if eval_sources else [], True)
        return RunData([], eval_examples, stream, record)
    loaded = load_sources(sources, "data", **common)
    refuse_other_kinds(config, "data", sources, loaded.formats)
    _say_notes(console, loaded.notes)
    records = loaded.records
    if not eval_sources and config.eval_split > 0:
        records, eval_records = _split_off(records, config.eval_split, config.seed)
        eval_examples = tokenize_records(eval_records, tokenizer, **kwargs)
    train_examples = tokenize_records(records, tokenizer, **kwargs)
    record = _data_record(sources, loaded.commits, eval_sources, eval_loaded.commits if eval_sources else [], False)
    return RunData(train_examples, eval_examples, None, record)


def _vision_tokenizers(config: TrainConfig, processor):
    """:func:`tokenize_records`' and :func:`tokenize_record`'s stand-ins for a vision-language run:
    records through ``processor`` (:mod:`memfit.train.data.vision`), with the run's image knobs."""
    from memfit.train.data.vision import tokenize_vision_record, tokenize_vision_records

    if config.packing:
        raise TrainError(
            "packing: true is not built for vision-language models (their batches are padded rows); remove it"
        )
    knobs = dict(
        max_images=config.spec.images, max_pixels=config.spec.image_max_pixels, model_type=processor_family(processor)
    )

    def many(records, _tokenizer, *, seq_len, train_on_inputs, packing):
        return tokenize_vision_records(records, processor, seq_len=seq_len, train_on_inputs=train_on_inputs, **knobs)

    def one(record, _tokenizer, seq_len, train_on_inputs):
        return tokenize_vision_record(record, processor, seq_len=seq_len, train_on_inputs=train_on_inputs, **knobs)

    return many, one


def processor_family(processor) -> str:
    """The model type a processor serves (``llava`` for LlavaProcessor...), as transformers names it."""
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    name = type(processor).__name__
    return next((family for family, cls in PROCESSOR_MAPPING_NAMES.items() if cls == name), name.lower())


def refuse_other_kinds(config: TrainConfig, name: str, sources, formats: list[str]) -> None:
    """Data the run's objective does not train on, refused in one line before anything trains: a
    next-token objective and preference pairs, a preference objective and other records, or a list
    of sources that holds both kinds (each source named with the format it holds)."""
    from memfit.train.data.sources import field_name

    if "prompt" in formats:
        raise TrainError(
            f"{name}: {_names(sources)} holds prompts alone (no completion, no pair), which objective: "
            f"{config.objective} does not train on. Set objective: grpo and reward_funcs (docs/grpo.md), or "
            "give completions."
        )
    pairs = config.spec.is_preference
    wrong = [index for index, fmt in enumerate(formats) if (fmt == "preference") != pairs]
    if not wrong:
        return
    if len(wrong) < len(formats):
        held = "; ".join(
            f"{field_name(name, i, len(sources))} ({s.label()}) holds {_kind(fmt)}"
            for i, (s, fmt) in enumerate(zip(sources, formats))
        )
        out = ", ".join(field_name(name, i, len(sources)) for i in wrong)
        trains, other = ("preference pairs", "sft") if pairs else ("records that are not pairs", "dpo, orpo or simpo")
        raise TrainError(
            f"{name}: {held}: they cannot be mixed in one objective, and objective: {config.objective} trains "
            f"on {trains}. Leave out {out}, or train on it in a run of its own with objective: {other}."
        )
    if pairs:
        others = sorted(set(formats))
        raise TrainError(
            f"{name}: objective: {config.objective} trains on preference pairs (chosen and rejected, with or without a "
            f"prompt), and {_names(sources)} holds {', '.join(others)} records. Give pairs (docs/preference.md), or use "
            "objective: sft for this data."
        )
    raise TrainError(
        f"{name}: {_names(sources)} holds preference pairs (chosen and rejected), which objective: "
        f"{config.objective} does not train on. Set objective: dpo, orpo or simpo (docs/preference.md)."
    )


def _kind(fmt: str) -> str:
    """What records of format ``fmt`` are, in a sentence."""
    return "preference pairs (chosen and rejected)" if fmt == "preference" else f"{fmt} records"


def _say_notes(console, notes: list[str]) -> None:
    """Print what the data reading noted (a Hub dataset read from the cache), once each."""
    for note in notes if console is not None else []:
        console.print(f"note: {note}", highlight=False)


def _prepare_pairs(
    config: TrainConfig, tokenizer, sources, eval_sources, common: dict, eval_loaded, console=None
) -> RunData:
    """A dpo, orpo or simpo run's data: preference pairs from every source (local files, Hub
    datasets, mixes), tokenized as TRL's DPOTrainer splits them and cut to ``seq_len``; the
    evaluation pairs split off or loaded. ``pair_stats`` says what the cut took."""
    from memfit.train.data.pairs import tokenize_pairs
    from memfit.train.data.reading import load_sources

    loaded = load_sources(sources, "data", **common)
    for name, used, read in (("data", sources, loaded), ("eval_data", eval_sources, eval_loaded)):
        if read is not None:
            refuse_other_kinds(config, name, used, read.formats)
    _say_notes(console, loaded.notes)
    records, eval_records = loaded.records, eval_loaded.records if eval_loaded is not None else []
    if not eval_sources and config.eval_split > 0:
        records, eval_records = _split_off(records, config.eval_split, config.seed)
    train_pairs, stats = tokenize_pairs(records, tokenizer, config.seq_len)
    eval_pairs = tokenize_pairs(eval_records, tokenizer, config.seq_len)[0] if eval_records else []
    record = _data_record(
        sources, loaded.commits, eval_sources, eval_loaded.commits if eval_loaded is not None else [], False
    )
    return RunData(train_pairs, eval_pairs, None, record, pair_stats=stats)


def _prepare_prompts(config: TrainConfig, tokenizer, sources, common: dict, console=None) -> RunData:
    """A grpo run's data: every source read as prompts (TRL's prompt-only format: a prompt, any other
    fields for the reward functions), tokenized, each cut to the prompt budget
    (:mod:`memfit.train.data.prompts`)."""
    from memfit.train.data.prompts import tokenize_prompts
    from memfit.train.data.reading import load_sources

    loaded = load_sources(sources, "data", **common)
    _say_notes(console, loaded.notes)
    prompts, stats = tokenize_prompts(loaded.records, tokenizer, config.spec.prompt_budget)
    record = _data_record(sources, loaded.commits, [], [], False)
    return RunData(prompts, [], None, record, prompt_stats=stats)


def prepare_examples(config: TrainConfig, tokenizer) -> tuple[list, list]:
    """The training and evaluation examples of data read in memory (:func:`prepare_data`)."""
    data = prepare_data(config.model_copy(update={"streaming": False}), tokenizer)
    return data.train_examples, data.eval_examples


def _split_off(records: list, eval_split: float, seed: int) -> tuple[list, list]:
    """(training records, evaluation records): ``eval_split`` of them held out, chosen by ``seed``."""
    order = list(range(len(records)))
    random.Random(f"memfit-eval-{seed}").shuffle(order)
    n_eval = max(1, round(eval_split * len(records)))
    if n_eval >= len(records):
        raise TrainError(f"eval_split: {eval_split} of {len(records)} records leaves nothing to train on")
    held = set(order[:n_eval])
    return [r for i, r in enumerate(records) if i not in held], [records[i] for i in sorted(held)]


def _names(sources) -> str:
    return ", ".join(s.label() for s in sources)


def _data_record(sources, commits, eval_sources, eval_commits, streaming: bool) -> dict[str, Any]:
    """What run.json keeps of the data: each source with the Hub commit it was read at."""

    def entries(items, used):
        return [
            {"path": s.path, "subset": s.subset, "split": s.split, "revision": s.revision, "commit": c}
            for s, c in zip(items, used)
        ]

    return {"streaming": streaming, "data": entries(sources, commits), "eval_data": entries(eval_sources, eval_commits)}


def recorded_commits(run_dir: Path | None) -> dict[str, list[dict[str, Any]]]:
    """The data sources an earlier run in ``run_dir`` recorded (its run.json), by config field."""
    try:
        record = json.loads((Path(run_dir) / "run.json").read_text(encoding="utf-8")).get("data") or {}
    except (OSError, ValueError, AttributeError, TypeError):
        return {}
    return {key: value for key, value in record.items() if key in ("data", "eval_data") and isinstance(value, list)}


def _pins(sources, recorded: list[dict[str, Any]] | None) -> list[str | None] | None:
    """The recorded commit of each source, where the recorded source is this one (same path,
    subset, split and revision); None when nothing was recorded."""
    if not recorded:
        return None
    pins = []
    for index, source in enumerate(sources):
        entry = recorded[index] if index < len(recorded) and isinstance(recorded[index], dict) else {}
        same = all(entry.get(key) == getattr(source, key) for key in ("path", "subset", "split", "revision"))
        pins.append(entry.get("commit") if same else None)
    return pins


def check_vocab(examples: list, vocab_size: int, tokenizer) -> None:
    """Every token id must have an embedding row; a tokenizer/model mismatch fails here, clearly."""
    if not vocab_size:
        return
    from memfit.step.preference import is_pair, pair_sequences

    sequences = [s for e in examples for s in (pair_sequences(e) if is_pair(e) else (e,))]
    largest = max((max(s["input_ids"]) for s in sequences if s["input_ids"]), default=-1)
    if largest >= vocab_size:
        raise TrainError(
            f"tokenizer: the data has token id {largest} but the model's vocab_size is {vocab_size} "
            f"(the tokenizer has {len(tokenizer)} tokens). Use the model's own tokenizer, or with init: random "
            f"set model_overrides: {{vocab_size: {len(tokenizer)}}}."
        )


#: The mark of a filler pair (:func:`unscored`).
UNSCORED = "unscored"


def unscored(example: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``example`` that scores nothing: a forward for the collectives, no loss.

    A sequence's labels are all ignored. A pair keeps its tokens (a preference loss of answers
    without a scored token is not a number) and is marked :data:`UNSCORED`: it counts as no pair
    (:func:`scored_count`), so its slice weighs nothing."""
    from memfit.step.labels import IGNORE_INDEX
    from memfit.step.preference import is_pair

    if is_pair(example):
        return {**example, UNSCORED: True}
    return {**example, "labels": [IGNORE_INDEX] * len(example["labels"])}


def scored_count(examples: list[dict[str, Any]], batch: dict[str, Any]) -> int:
    """What the loss of ``examples`` (collated: ``batch``) is a mean over: its pairs (a preference
    batch; filler pairs left out), or its labelled tokens."""
    from memfit.step.batch import labelled_tokens

    if "pairs" in batch:
        return sum(1 for example in examples if not example.get(UNSCORED))
    if "shift_labels" in batch:  # a sequence-parallel shard: its labels already shifted over the whole row
        from memfit.step.sequence_parallel import shard_tokens

        return shard_tokens(batch)
    return labelled_tokens(batch["labels"])
