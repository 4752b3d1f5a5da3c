"""Catalog of GPUs the planner can target (memory, architecture, peak rates).

The data lives in ``gpus.yaml`` next to this module; see its header for what
each field means and where the figures come from.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

from memfit.errors import UserError
from memfit.units import MiB

ARCHS = ("volta", "turing", "ampere", "ada", "hopper", "blackwell")


class UnknownGpuError(UserError, ValueError):
    """A GPU name that matches no catalog entry or alias."""


@dataclass(frozen=True)
class Gpu:
    """One catalog entry.

    ``memory_bytes`` is the total nvidia-smi reports, the budget the planner
    checks its device total (allocator reserved + CUDA context) against.
    TFLOPS and bandwidth are published peak figures, not measurements.
    """

    name: str
    display_name: str
    memory_bytes: int
    arch: str
    compute_capability: tuple[int, int]
    supports_bf16: bool
    bf16_tflops: float | None
    memory_bandwidth_gbps: float
    aliases: tuple[str, ...]
    fp16_tflops: float | None = None
    source: str = ""


_PREFIXES = ("nvidia", "geforce", "tesla")


def normalize_gpu_name(name: str) -> str:
    """Lowercase, drop spaces/'-'/'_'/punctuation and vendor words.

    ``"NVIDIA GeForce RTX 4090"``, ``"rtx_4090"`` and ``"RTX-4090"`` all give
    ``"rtx4090"``.
    """
    key = re.sub(r"[^a-z0-9]", "", name.lower())
    stripped = True
    while stripped:
        stripped = False
        for prefix in _PREFIXES:
            if key.startswith(prefix) and len(key) > len(prefix):
                key = key[len(prefix) :]
                stripped = True
    return key


def _parse_entry(name: str, raw: object, problems: list[str]) -> Gpu | None:
    where = f"gpus.yaml entry {name!r}"
    if not isinstance(raw, dict):
        problems.append(f"{where}: expected a mapping of fields, got {type(raw).__name__}")
        return None
    required = {
        "display_name": str,
        "memory_mib": int,
        "arch": str,
        "compute_capability": str,
        "supports_bf16": bool,
        "memory_bandwidth_gbps": (int, float),
    }
    before = len(problems)
    for field, kind in required.items():
        value = raw.get(field)
        if value is None or (isinstance(value, bool) and kind is not bool) or not isinstance(value, kind):
            problems.append(f"{where}: field {field!r} is {value!r}, expected {kind}")
    for field in ("bf16_tflops", "fp16_tflops"):
        value = raw.get(field)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            problems.append(f"{where}: field {field!r} is {value!r}, expected a number or null")
    aliases = raw.get("aliases", [])
    if not isinstance(aliases, list) or not all(isinstance(a, str) for a in aliases):
        problems.append(f"{where}: field 'aliases' must be a list of strings, got {aliases!r}")
    unknown = set(raw) - set(required) - {"bf16_tflops", "fp16_tflops", "aliases", "source"}
    if unknown:
        problems.append(f"{where}: unknown fields {sorted(unknown)}")
    if len(problems) > before:
        return None
    if raw["arch"] not in ARCHS:
        problems.append(f"{where}: arch {raw['arch']!r} is not one of {', '.join(ARCHS)}")
    match = re.fullmatch(r"(\d+)\.(\d+)", raw["compute_capability"])
    if match is None:
        problems.append(f"{where}: compute_capability {raw['compute_capability']!r} is not 'major.minor'")
    if raw["supports_bf16"] != (raw.get("bf16_tflops") is not None):
        problems.append(f"{where}: supports_bf16 and bf16_tflops disagree")
    if len(problems) > before:
        return None
    return Gpu(
        name=name,
        display_name=raw["display_name"],
        memory_bytes=raw["memory_mib"] * MiB,
        arch=raw["arch"],
        compute_capability=(int(match.group(1)), int(match.group(2))),
        supports_bf16=raw["supports_bf16"],
        bf16_tflops=None if raw.get("bf16_tflops") is None else float(raw["bf16_tflops"]),
        memory_bandwidth_gbps=float(raw["memory_bandwidth_gbps"]),
        aliases=tuple(aliases),
        fp16_tflops=None if raw.get("fp16_tflops") is None else float(raw["fp16_tflops"]),
        source=str(raw.get("source", "")),
    )


def parse_catalog(text: str) -> dict[str, Gpu]:
    """Parse catalog YAML; every problem is collected and raised once."""
    import yaml

    data = yaml.safe_load(text)
    if not isinstance(data, dict):
        raise ValueError("gpus.yaml must be a mapping of GPU name -> fields")
    problems: list[str] = []
    gpus: dict[str, Gpu] = {}
    owner: dict[str, str] = {}  # normalized name or alias -> entry
    for name, raw in data.items():
        if not isinstance(name, str) or not re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", name):
            problems.append(f"gpus.yaml entry name {name!r} must be kebab-case, e.g. 'rtx-4090'")
            continue
        gpu = _parse_entry(name, raw, problems)
        if gpu is None:
            continue
        for label in (name, *gpu.aliases):
            key = normalize_gpu_name(label)
            if key in owner and owner[key] != name:
                problems.append(f"gpus.yaml: {label!r} of {name!r} clashes with {owner[key]!r}")
            owner[key] = name
        gpus[name] = gpu
    if problems:
        raise ValueError("invalid GPU catalog:\n  " + "\n  ".join(problems))
    return gpus


@lru_cache(maxsize=1)
def _catalog() -> tuple[dict[str, Gpu], dict[str, str]]:
    text = resources.files("memfit.models").joinpath("gpus.yaml").read_text(encoding="utf-8")
    gpus = parse_catalog(text)
    index = {}
    for gpu in gpus.values():
        for label in (gpu.name, *gpu.aliases):
            index[normalize_gpu_name(label)] = gpu.name
    return gpus, index


def load_gpus() -> dict[str, Gpu]:
    """All catalog GPUs by canonical name (read once, then cached)."""
    return dict(_catalog()[0])


def get_gpu(name: str) -> Gpu:
    """Look a GPU up by canonical name, alias or torch device name.

    Case, spaces, '-' and '_' do not matter, nor a leading "NVIDIA",
    "GeForce" or "Tesla". Raises ``UnknownGpuError`` with close matches and
    the list of known names.
    """
    gpus, index = _catalog()
    key = normalize_gpu_name(name) if isinstance(name, str) else ""
    if key in index:
        return gpus[index[key]]
    # cards whose name starts with the query first ("a100" -> both A100s),
    # then spelling neighbours
    prefixed = sorted(index[k] for k in index if key and k.startswith(key))
    close = difflib.get_close_matches(key, list(index), n=5, cutoff=0.5)
    suggestions = list(dict.fromkeys([*prefixed, *(index[c] for c in close)]))[:4]
    hint = f" Did you mean {' or '.join(repr(s) for s in suggestions)}?" if suggestions else ""
    raise UnknownGpuError(f"unknown GPU {name!r}.{hint} Known GPUs: {', '.join(sorted(gpus))}.")
