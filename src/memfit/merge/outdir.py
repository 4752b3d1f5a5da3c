"""The output folder: checks before the merge, a private build folder, and the final swap.

The merged checkpoint is built in `<out>.partial-<pid>-XXXX` beside `--out` and only renamed to
`--out` once every shard, the index and the config are on disk, so an interrupted merge never
leaves a folder that looks complete; the next merge to the same `--out` removes what a merge whose
process is gone left there (:func:`remove_stale_builds`). With --overwrite the old `--out` is moved
aside, the new one renamed in, and only then is the old one deleted, and only when memfit wrote it:
a merge leaves a marker file (:data:`MARKER`), and a folder without it, or holding anything a merge
does not write, is never replaced.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

from memfit.files import (
    check_folder_writable,
    input_clash,
    make_temp_folder,
    process_alive,
    write_atomic,
)

from .errors import MergeError

#: Written by every merge into its output: what was merged, and the proof, for --overwrite, that
#: memfit wrote the folder.
MARKER = "memfit-merge.json"
GENERATOR = "memfit merge"

# Files copied from the base folder as they are (config.json is rewritten, see write_config).
MODEL_FILES = ("generation_config.json",)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
)
# Any of these in the adapter folder means the training run saved its tokenizer there.
_TOKENIZER_MARKERS = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model")


def _is_within(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def check_paths(base: Path, adapter: Path, out: Path, overwrite: bool) -> Path:
    """Refuse output locations that could hurt the inputs or an existing folder; returns `out` resolved."""
    clash = input_clash(out, "--out", {"--base folder": base, "--adapter folder": adapter}, overwrite=overwrite)
    if clash:
        raise MergeError(clash)
    base_r, adapter_r, out_r = (Path(p).expanduser().resolve() for p in (base, adapter, out))
    if _is_within(out_r, base_r):
        raise MergeError(
            f"--out {out} is inside --base {base} (resolved {out_r}): choose a folder outside the base model."
        )
    if _is_within(base_r, out_r):
        raise MergeError(f"--out {out} contains --base {base}: choose a folder that does not hold the base model.")
    if _is_within(adapter_r, out_r):
        raise MergeError(
            f"--out {out} is or contains --adapter {adapter}: choose a separate folder for the merged model."
        )
    if out_r.exists() and not out_r.is_dir():
        raise MergeError(f"--out {out} exists and is not a folder: choose a folder path.")
    if out_r.is_dir() and any(out_r.iterdir()):
        if not overwrite:
            raise MergeError(
                f"--out {out} is not empty: pass --overwrite to replace an earlier merge there (the old content is kept "
                "until the new merge is complete), or choose another --out."
            )
        problem = replace_problem(out_r)
        if problem:
            raise MergeError(
                f"--out {out}: --overwrite replaces only a folder memfit merge wrote, and {problem}. "
                "Choose another --out, or delete that folder yourself if it is yours to delete."
            )
    if not out_r.parent.is_dir():
        raise MergeError(f"--out {out}: parent folder {out_r.parent} does not exist.")
    check_folder_writable(out_r, "--out")
    return out_r


#: Shards as transformers and memfit name them: model.safetensors, model-00001-of-00004.safetensors.
_SHARD_NAME = re.compile(r"^model(-\d+-of-\d+)?\.safetensors$")


def replace_problem(out: Path) -> str | None:
    """Why ``--overwrite`` may not replace folder ``out`` (None when it may): it must hold the
    marker of a merge and nothing a merge does not write (a user's file added since is never lost)."""
    try:
        marker = json.loads((out / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        marker = None
    if not isinstance(marker, dict) or marker.get("generator") != GENERATOR:
        return f"it has no {MARKER} (it was not written by memfit merge)"
    merge_names = {MARKER, "config.json", "model.safetensors.index.json", *MODEL_FILES, *TOKENIZER_FILES}
    foreign = sorted(
        p.name for p in out.iterdir() if not (p.is_file() and (p.name in merge_names or _SHARD_NAME.match(p.name)))
    )
    if foreign:
        listed = ", ".join(repr(n) for n in foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        return f"it also holds what a merge does not write ({listed})"
    return None


def write_marker(build: Path, base: str, adapter: str, dtype: str | None) -> None:
    """The marker file of a merge output (see :data:`MARKER`)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        memfit_version = version("memfit")
    except PackageNotFoundError:  # run from a source tree that is not installed
        memfit_version = None
    write_json_atomic(
        build / MARKER,
        {
            "generator": GENERATOR,
            "version": memfit_version,
            "base": base,
            "adapter": adapter,
            "dtype": dtype,
            "merged_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        },
    )


def check_free_space(out: Path, needed_bytes: int) -> None:
    """Refuse up front when the merged checkpoint cannot fit beside whatever is there."""
    free_bytes = shutil.disk_usage(out.parent).free
    if free_bytes < needed_bytes:
        raise MergeError(
            f"--out {out}: {needed_bytes / 2**30:.2f} GiB needed for the merged model but only {free_bytes / 2**30:.2f} GiB free on that disk."
        )


def make_build_folder(out: Path) -> Path:
    """A fresh folder beside `out` to build the merged checkpoint in, named with this process's id
    (so that a later merge can tell it was abandoned) and with the permissions `mkdir` gives."""
    return make_temp_folder(f"{out.name}.partial-{os.getpid()}-", out.parent)


def _stale_name(out: Path) -> re.Pattern:
    return re.compile(rf"^{re.escape(out.name)}\.(?:partial|old)-(\d+)-[^/]+$")


def remove_stale_builds(out: Path) -> tuple[list[Path], list[Path]]:
    """(removed, unsure): folders beside ``out`` that interrupted merges to ``out`` left.

    ``<out>.partial-<pid>-XXXX`` and ``<out>.old-<pid>-XXXX`` whose process is gone are removed; older
    ``<out>.partial-XXXX`` (without a process id) cannot be proven abandoned and are only returned.
    """
    removed, unsure = [], []
    if not out.parent.is_dir():
        return removed, unsure
    pattern = _stale_name(out)
    for path in sorted(out.parent.iterdir()):
        if not path.is_dir() or not path.name.startswith(f"{out.name}."):
            continue
        match = pattern.match(path.name)
        if match and not process_alive(int(match.group(1))):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        elif not match and re.match(rf"^{re.escape(out.name)}\.partial-[^-]+$", path.name):
            unsure.append(path)
    return removed, unsure


def tokenizer_source(base: Path, adapter: Path) -> Path:
    """The adapter folder when the training run saved a tokenizer there, else the base folder.

    The adapter's copy is what training used (chat template, pad token); files are never mixed
    from the two folders.
    """
    return adapter if any((adapter / name).is_file() for name in _TOKENIZER_MARKERS) else base


def copy_side_files(base: Path, adapter: Path, build: Path) -> list[str]:
    """Copy generation config and tokenizer files into the build folder; returns the names copied."""
    copied = []
    for name in MODEL_FILES:
        if (base / name).is_file():
            shutil.copy2(base / name, build / name)
            copied.append(name)
    source = tokenizer_source(base, adapter)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, build / name)
            copied.append(name)
    return copied


def write_config(config: dict, build: Path, dtype_name: str | None, untied: bool) -> None:
    """config.json of the base, with the dtype and tie flag updated when the merge changed them."""
    config = dict(config)
    if dtype_name is not None:
        keys = [k for k in ("dtype", "torch_dtype") if k in config] or ["dtype"]
        for key in keys:
            config[key] = dtype_name
    if untied:
        config["tie_word_embeddings"] = False
        if isinstance(config.get("text_config"), dict) and "tie_word_embeddings" in config["text_config"]:
            config["text_config"] = {**config["text_config"], "tie_word_embeddings": False}
    write_json_atomic(build / "config.json", config)


def write_json_atomic(path: Path, data: dict) -> None:
    write_atomic(path, json.dumps(data, indent=2, sort_keys=False) + "\n")


def publish(build: Path, out: Path) -> None:
    """Move the finished build folder to `out`, swapping out any old content only at the end."""
    if not out.exists():
        os.rename(build, out)
        return
    if not any(out.iterdir()):
        out.rmdir()
        os.rename(build, out)
        return
    old = make_temp_folder(f"{out.name}.old-{os.getpid()}-", out.parent)
    old.rmdir()  # only the unique name is wanted; rename needs the target to be absent
    os.rename(out, old)
    try:
        os.rename(build, out)
    except BaseException:
        os.rename(old, out)  # put the previous merge back
        raise
    shutil.rmtree(old, ignore_errors=True)
