"""The shipped model catalog, and turning a user's model argument into a config.

A model argument is one of: a catalog name (``llama-3.1-8b``), a path to a ``config.json``, a
local Hugging Face model folder that holds one, or a Hugging Face Hub id (``org/name``, whose
config.json alone is fetched: :mod:`memfit.models.hub`). In that order: a local path wins over a
Hub id of the same spelling, and a catalog name never has a slash, so it is never a Hub id. The
catalog files are the ``config.json`` files the model authors publish with their weights;
``SOURCES.md`` beside them says where each came from (a Hub id that is a catalog entry's source is
still fetched from the Hub; the shipped copy stands in only when the Hub cannot answer).
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

from memfit.errors import shown
from memfit.models.config_file import read_config_file
from memfit.models.errors import HubError, ModelNotFoundError

#: The longest model argument memfit takes: more than any catalog name, Hub id (org/name, at most
#: 96 characters each) or path one types; a longer one is a mistake (a paste gone wrong).
MAX_MODEL_CHARS = 1024

__all__ = [
    "MAX_MODEL_CHARS",
    "ModelNotFoundError",
    "ModelSource",
    "PeftAdapter",
    "Variant",
    "catalog_names",
    "catalog_sources",
    "catalog_variants",
    "load_catalog_config",
    "model_argument_problem",
    "peft_adapter",
    "resolve_model",
    "resolve_source",
    "suggestions",
]


@dataclass(frozen=True)
class ModelSource:
    """A resolved model argument: its display name, its config dict and where it came from."""

    name: str
    config: dict[str, Any]
    origin: str  # "catalog", "config.json", "folder" or "hub"
    path: Path | None = None  # the folder (for a local model or a Hub snapshot) or config file
    note: str | None = None  # how the config was obtained when that is worth saying (cached copy, shipped copy)
    hub: dict[str, str] | None = None  # repo_id, revision and commit of a Hub model


def _catalog_dir():
    return resources.files("memfit.models") / "catalog"


@lru_cache(maxsize=1)
def catalog_names() -> tuple[str, ...]:
    """Names of the shipped model configs, sorted."""
    return tuple(sorted(p.name[: -len(".json")] for p in _catalog_dir().iterdir() if p.name.endswith(".json")))


def load_catalog_config(name: str) -> dict[str, Any]:
    """The config dict of catalog model ``name`` (exact name)."""
    return json.loads((_catalog_dir() / f"{name}.json").read_text())


def _normalise(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace(" ", "-")


def model_argument_problem(text: str) -> str | None:
    """Why ``text`` cannot be a model argument at all, whatever it names (None when it can): longer
    than :data:`MAX_MODEL_CHARS`. The page's model names and the command line's arguments alike."""
    if len(text) <= MAX_MODEL_CHARS:
        return None
    return (
        f"{shown(text)} is longer than a model name or path can be (at most {MAX_MODEL_CHARS:,} characters); give a "
        "catalog name (`memfit models`), a Hugging Face Hub id (org/name) or the path to a config.json."
    )


def _local_kind(path: Path) -> str | None:
    """``"folder"``, ``"file"``, or None when nothing is at ``path`` or it cannot be a path here (a
    name longer than the file system takes: then it is a name, or a mistake)."""
    try:
        return "folder" if path.is_dir() else "file" if path.is_file() else "other" if path.exists() else None
    except OSError:  # ENAMETOOLONG and the like: no file can have this name
        return None


def resolve_model(model: str | Path | dict, revision: str | None = None) -> ModelSource:
    """Resolve a catalog name, a config.json path, a model folder, a Hub id (or a config dict) to a ModelSource.

    ``revision`` (branch, tag or commit) applies to a Hub id only.

    Raises :class:`ModelNotFoundError` with a "did you mean" hint for unknown names, and with the
    file and the parser's message for an unreadable or invalid config.json;
    :class:`~memfit.models.errors.HubError` (a ValueError too) when a Hub id cannot be fetched.
    """
    if revision is not None:
        from memfit.models.hub import is_hub_id

        if isinstance(model, dict) or not is_hub_id(str(model)):
            what = "a config dict" if isinstance(model, dict) else repr(str(model))
            raise ModelNotFoundError(
                f"revision {revision!r} applies only to a Hugging Face Hub id (org/name), and {what} is a catalog "
                "name or a local path: leave the revision out."
            )
    if isinstance(model, dict):
        return ModelSource(
            name=str(model.get("_name_or_path") or model.get("model_type") or "custom"),
            config=dict(model),
            origin="dict",
        )
    text = str(model)
    too_long = model_argument_problem(text)
    if too_long:
        raise ModelNotFoundError(too_long)
    path = Path(text).expanduser()
    key = _normalise(text)
    local = _local_kind(path)
    if key in catalog_names() and local is None:
        return ModelSource(name=key, config=load_catalog_config(key), origin="catalog")
    if local == "folder":
        config_path = path / "config.json"
        if not config_path.is_file():
            raise ModelNotFoundError(
                f"model folder {str(path)!r} has no config.json. Point to a Hugging Face model folder "
                "(with config.json and *.safetensors), a config.json file, or a catalog name (see `memfit models`)."
            )
        return ModelSource(name=path.resolve().name, config=read_config_file(config_path), origin="folder", path=path)
    if local == "file":
        return ModelSource(
            name=_name_from_config_path(path), config=read_config_file(path), origin="config.json", path=path
        )
    from memfit.models.hub import looks_like_hub_id

    if looks_like_hub_id(text):  # not a local path (checked above): the Hub
        return resolve_source(text, revision)
    if any(sep in text for sep in ("/", "\\")) or text.endswith(".json"):
        raise ModelNotFoundError(f"model path {text!r} does not exist.")
    close = difflib.get_close_matches(key, catalog_names(), n=3, cutoff=0.5)
    hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    raise ModelNotFoundError(
        f"unknown model {text!r}.{hint} Use a catalog name (`memfit models` lists them), a Hugging Face Hub id "
        "(org/name), a path to a config.json, or a local model folder."
    )


# ------------------------------------------------------------------------------------------------
# The catalog's Hub ids: where each shipped config.json was copied from


@lru_cache(maxsize=1)
def _catalog_table() -> tuple[tuple[str, str], ...]:
    """(catalog name, Hub repo id its shipped config.json was copied from), from the catalog's
    SOURCES.md table; rows whose model column is not one exact repo id are left out (their copy
    may come from a sibling variant)."""
    from memfit.models.hub import looks_like_hub_id

    names = set(catalog_names())
    text = (_catalog_dir() / "SOURCES.md").read_text()
    rows = []
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0] in names and looks_like_hub_id(cells[1]):
            rows.append((cells[0], cells[1]))
    return tuple(rows)


def catalog_sources() -> dict[str, str]:
    """Hub repo id (lower case) -> the catalog name whose shipped config.json was copied from it."""
    return {repo.lower(): name for name, repo in _catalog_table()}


@dataclass(frozen=True)
class Variant:
    """A Hub id whose config.json has a catalog entry's shape (SOURCES.md, "Other Hub ids with a
    catalog entry's shape"): an instruct model and its base, a renamed repo."""

    repo_id: str
    catalog_name: str
    max_position_embeddings: int | None  # the variant's own, where it differs from the catalog entry's
    differs: str  # what its config.json has otherwise

    def config(self) -> dict[str, Any]:
        """The catalog entry's config, with the variant's ``max_position_embeddings``."""
        config = load_catalog_config(self.catalog_name)
        if self.max_position_embeddings is not None:
            config["max_position_embeddings"] = self.max_position_embeddings
        return config


@lru_cache(maxsize=1)
def catalog_variants() -> dict[str, Variant]:
    """Hub repo id (lower case) -> :class:`Variant`, from the second table of SOURCES.md."""
    from memfit.models.hub import looks_like_hub_id

    names = set(catalog_names())
    text = (_catalog_dir() / "SOURCES.md").read_text()
    variants = {}
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 4 and looks_like_hub_id(cells[0]) and cells[1] in names:
            positions = int(cells[2]) if cells[2] else None
            variants[cells[0].lower()] = Variant(cells[0], cells[1], positions, cells[3])
    return variants


def _stand_in(repo_id: str) -> tuple[dict[str, Any], str] | None:
    """(config, what it is) of the shipped config that stands in for Hub id ``repo_id`` when the Hub
    cannot answer: the catalog entry copied from it, or the entry whose shape it has."""
    name = catalog_sources().get(repo_id.lower())
    if name is not None:
        return load_catalog_config(
            name
        ), f"memfit's shipped copy of {repo_id}'s config.json (catalog name {name}), which needs no network"
    variant = catalog_variants().get(repo_id.lower())
    if variant is None:
        return None
    source = dict(_catalog_table())[variant.catalog_name]
    positions = (
        f"; max_position_embeddings {variant.max_position_embeddings} is {repo_id}'s"
        if variant.max_position_embeddings
        else ""
    )
    return variant.config(), (
        f"memfit's shipped copy of {source}'s config.json (catalog name {variant.catalog_name}), which "
        f"needs no network: {repo_id} has its shape (its config.json differs in {variant.differs}"
        f"{positions})"
    )


def suggestions(repo_id: str) -> list[str]:
    """Close Hub ids (catalog sources) and catalog names for a repo id that does not exist."""
    spelled = {repo.lower(): repo for _, repo in _catalog_table()}
    by_id = difflib.get_close_matches(repo_id.lower(), list(spelled), n=1, cutoff=0.8)
    name = repo_id.split("/")[-1].lower().replace("_", "-")
    by_name = difflib.get_close_matches(name, catalog_names(), n=2, cutoff=0.6)
    return [f"the Hub's {spelled[s]!r}" for s in by_id] + [f"the catalog's {n!r}" for n in by_name]


def resolve_source(repo_id: str, revision: str | None = None) -> ModelSource:
    """The :class:`ModelSource` of a Hub id (config.json only, fetched by :mod:`memfit.models.hub`).

    When the Hub cannot be asked (no network, HF_HUB_OFFLINE=1 with nothing cached, a gated repo
    this machine has no access to, or a Hugging Face cache that cannot be used), no revision is
    pinned, and ``repo_id`` is the repo a catalog config was copied from, or a variant with that
    config's shape (an instruct model of its base: SOURCES.md), the shipped copy is used, with a
    note saying which.
    """
    from memfit.models.hub import fetch_config, read_config

    try:
        snapshot = fetch_config(repo_id, revision, suggest=suggestions)
    except HubError as err:
        stand_in = _stand_in(repo_id)
        if stand_in is None or revision is not None or err.kind not in ("gated", "network", "offline", "cache"):
            raise
        config, what = stand_in
        return ModelSource(name=repo_id, config=config, origin="catalog", note=f"{err.reason}: planned with {what}")
    name = repo_id if revision is None else f"{repo_id}@{revision}"
    return ModelSource(
        name=name,
        config=read_config(snapshot),
        origin="hub",
        path=snapshot.folder,
        note=snapshot.note,
        hub=snapshot.record(),
    )


# ------------------------------------------------------------------------------------------------
# A PEFT adapter where a model is named: transformers loads it as its base with the adapter


@dataclass(frozen=True)
class PeftAdapter:
    """A PEFT adapter named where a model is expected (``adapter_config.json``, no config.json):
    ``from_pretrained`` loads its base (``base_model_name_or_path``) and the adapter on it."""

    name: str  # the Hub id or folder named
    config: dict[str, Any]  # adapter_config.json
    hub: dict[str, str] | None = None  # repo_id, revision and commit of a Hub adapter

    @property
    def base(self) -> str | None:
        base = self.config.get("base_model_name_or_path")
        return base.strip() if isinstance(base, str) and base.strip() else None

    @property
    def base_revision(self) -> str | None:
        revision = self.config.get("revision")  # PEFT's: the base model's revision
        return revision if isinstance(revision, str) and revision not in ("", "main") else None


def peft_adapter(model: str, revision: str | None = None) -> PeftAdapter | None:
    """The PEFT adapter ``model`` names (a folder, or a Hub id: one listing of the repo), or None when
    it is a model, a catalog name, or cannot be told (the Hub cannot answer: resolving the model
    says why). Raises :class:`ModelNotFoundError` for an adapter_config.json that is not JSON."""
    path = Path(str(model)).expanduser()
    if path.is_dir():
        file = path / "adapter_config.json"
        if (path / "config.json").is_file() or not file.is_file():
            return None
        return PeftAdapter(str(path), _adapter_config(file))
    from memfit.models.hub import fetch_adapter_config, is_hub_id

    # A catalog entry's source or variant is a model: no need to ask the Hub.
    if not is_hub_id(str(model)) or str(model).lower() in catalog_sources() or str(model).lower() in catalog_variants():
        return None
    try:
        snapshot = fetch_adapter_config(str(model), revision)
    except HubError:
        return None
    if snapshot is None:
        return None
    return PeftAdapter(str(model), _adapter_config(snapshot.folder / "adapter_config.json"), hub=snapshot.record())


def _adapter_config(file: Path) -> dict[str, Any]:
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ModelNotFoundError(f"{str(file)!r} cannot be read as a PEFT adapter's config: {err}") from None
    if not isinstance(config, dict):
        raise ModelNotFoundError(f"{str(file)!r} is not a PEFT adapter's config (a JSON object)")
    return config


def model_type_problem(config: dict[str, Any]) -> str | None:
    """Why transformers cannot build a causal LM from ``config``'s ``model_type`` (None when it can),
    in one line with the closest known types: the full list has hundreds of names."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from memfit.models.vision import is_vision_config, supported_families

    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        return f'model_type {model_type!r} is not an architecture name (e.g. "model_type": "llama").'
    if is_vision_config(config) and model_type in supported_families():
        return None  # a vision-language model memfit plans whole (memfit.models.vision)
    if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return _nested_language_model(config, model_type)
    import transformers

    if model_type in CONFIG_MAPPING_NAMES:
        return (
            f"model_type {model_type!r} has no causal language model in transformers {transformers.__version__} "
            "(AutoModelForCausalLM): memfit fine-tunes causal LMs (Llama, Qwen, Mistral, Gemma, GPT-2...)."
        )
    close = difflib.get_close_matches(model_type, sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES), n=3, cutoff=0.6)
    hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    return (
        f"model_type {model_type!r} is not an architecture transformers {transformers.__version__} knows.{hint} "
        "(A new architecture needs a newer transformers: pip install -U transformers.)"
    )


def _nested_language_model(config: dict[str, Any], model_type: str) -> str | None:
    """Why a config that holds its language model under ``text_config`` (a vision-language model's,
    such as Qwen3.5's) cannot be planned as it is, or None."""
    text = config.get("text_config")
    if not isinstance(text, dict) or "num_hidden_layers" in config:
        return None
    inner = text.get("model_type") or f"{model_type}_text"
    return (
        f"model_type {model_type!r} is a multimodal config whose language model is under text_config: memfit "
        f"fine-tunes the language model alone. Give its text_config as the config (model_type {inner!r})."
    )


def max_positions(config: dict[str, Any]) -> int | None:
    """The longest sequence ``config`` says the model takes (``max_position_embeddings``, or GPT-2's
    ``n_positions``), or None when it does not say."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    value = config.get("max_position_embeddings") or config.get("n_positions") or text.get("max_position_embeddings")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def seq_len_problem(name: str, config: dict[str, Any], seq_len: int, spelling: str = "flag") -> str | None:
    """Why ``seq_len`` is too long for model ``name`` (None when it is not), naming the knob as the
    user wrote it (``--seq-len`` or ``seq_len:``, see :func:`memfit.spec.spell`)."""
    from memfit.spec import spell, spell_setting

    limit = max_positions(config)
    if limit is None or seq_len <= limit:
        return None
    return (
        f"{spell('seq_len', spelling)}: {seq_len} is beyond {name}'s max_position_embeddings ({limit}). "
        f"Use {spell_setting('seq_len', limit, spelling)} or less (or extend the context with RoPE scaling in the config)."
    )


def _name_from_config_path(path: Path) -> str:
    return path.resolve().parent.name if path.name == "config.json" else path.stem
