"""The output folder: checks before the merge, a private build folder, and the final swap.

The merged checkpoint is built in `<out>.partial-XXXX` beside `--out` and only renamed to
`--out` once every shard, the index and the config are on disk, so an interrupted merge never
leaves a folder that looks complete. With --overwrite the old `--out` is moved aside, the new one
renamed in, and only then is the old one deleted.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from memfit.files import write_atomic

from .errors import MergeError

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
    base_r, adapter_r, out_r = (Path(p).expanduser().resolve() for p in (base, adapter, out))
    if _is_within(out_r, base_r):
        raise MergeError(f"--out {out} is inside --base {base} (resolved {out_r}): choose a folder outside the base model.")
    if _is_within(base_r, out_r):
        raise MergeError(f"--out {out} contains --base {base}: choose a folder that does not hold the base model.")
    if _is_within(adapter_r, out_r):
        raise MergeError(f"--out {out} is or contains --adapter {adapter}: choose a separate folder for the merged model.")
    if out_r.exists() and not out_r.is_dir():
        raise MergeError(f"--out {out} exists and is not a folder: choose a folder path.")
    if out_r.is_dir() and any(out_r.iterdir()) and not overwrite:
        raise MergeError(f"--out {out} is not empty: pass --overwrite to replace it (the old content is kept until the new merge is complete).")
    if not out_r.parent.is_dir():
        raise MergeError(f"--out {out}: parent folder {out_r.parent} does not exist.")
    if not os.access(out_r.parent, os.W_OK):
        raise MergeError(f"--out {out}: parent folder {out_r.parent} is not writable.")
    return out_r


def check_free_space(out: Path, needed_bytes: int) -> None:
    """Refuse up front when the merged checkpoint cannot fit beside whatever is there."""
    free_bytes = shutil.disk_usage(out.parent).free
    if free_bytes < needed_bytes:
        raise MergeError(
            f"--out {out}: {needed_bytes / 2**30:.2f} GiB needed for the merged model but only {free_bytes / 2**30:.2f} GiB free on that disk."
        )


def make_build_folder(out: Path) -> Path:
    """A fresh private folder beside `out` to build the merged checkpoint in."""
    return Path(tempfile.mkdtemp(prefix=f"{out.name}.partial-", dir=out.parent))


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
    old = Path(tempfile.mkdtemp(prefix=f"{out.name}.old-", dir=out.parent))
    old.rmdir()  # only the unique name is wanted; rename needs the target to be absent
    os.rename(out, old)
    try:
        os.rename(build, out)
    except BaseException:
        os.rename(old, out)  # put the previous merge back
        raise
    shutil.rmtree(old, ignore_errors=True)
