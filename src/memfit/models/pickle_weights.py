"""Convert a pickled PyTorch checkpoint (``pytorch_model*.bin``, ``adapter_model.bin``) to safetensors, once.

memfit's loaders (training, merging) read safetensors only. A Hub repo that has only ``.bin``
weights is used when the user opts in (``allow_pickle_weights``): its files are read with
``torch.load(weights_only=True)``, PyTorch's restricted unpickler, which refuses anything but
tensors and plain containers, and written as safetensors into memfit's cache
(``$MEMFIT_CACHE``, default ``$XDG_CACHE_HOME/memfit`` or ``~/.cache/memfit``), under
``converted/models--org--name/<commit>``. The Hugging Face cache itself is never written.

The folder is built under a temporary name and renamed into place once complete, so a half-done
conversion is never mistaken for a finished one; the next run finds the finished folder (the
commit fixes its content) and converts nothing.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from memfit.files import apply_umask, make_temp_folder, memfit_cache_dir
from memfit.models.errors import HubError


def safetensors_name(name: str) -> str:
    """``pytorch_model-00001-of-00002.bin`` -> ``model-00001-of-00002.safetensors``; ``adapter_model.bin`` -> ``adapter_model.safetensors``."""
    stem = name[: -len(".bin")] if name.endswith(".bin") else name
    if stem.startswith("pytorch_model"):
        stem = "model" + stem[len("pytorch_model") :]
    return stem + ".safetensors"


def convert_checkpoint(
    folder: Path, repo_id: str, commit: str, files: list[str], index: str | None, *, console=None
) -> Path:
    """A folder like ``folder`` with the pickled ``files`` (and their ``index``) as safetensors.

    Every other file of ``folder`` (config, tokenizer) is copied beside them. Returns the finished
    folder in memfit's cache; raises :class:`~memfit.models.errors.HubError` when a file holds
    anything but tensors.
    """
    dest = memfit_cache_dir() / "converted" / ("models--" + repo_id.replace("/", "--")) / commit
    if dest.is_dir():
        return dest
    build = dest.parent / f"{commit}.partial"
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        build = make_temp_folder(f"{commit}.partial-", dest.parent)  # the permissions mkdir gives, not 0700
        skip = set(files) | ({index} if index else set())
        for path in sorted(Path(folder).iterdir()):
            if path.is_file() and path.name not in skip:
                shutil.copyfile(path, build / path.name)
        if console is not None:
            console.print(
                f"converting {len(files)} pickled weight file(s) of {repo_id} to safetensors in {dest}", highlight=False
            )
        weight_map: dict[str, str] = {}
        total_bytes = 0
        for name in files:
            tensors = _load_tensors(Path(folder) / name, repo_id)
            out_name = safetensors_name(name)
            from safetensors.torch import save_file

            save_file(tensors, str(build / out_name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(tensors, out_name))
            total_bytes += sum(t.numel() * t.element_size() for t in tensors.values())
            del tensors
        if index:
            text = json.dumps(
                {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}, indent=2
            )
            (build / "model.safetensors.index.json").write_text(text + "\n")
        apply_umask(build)  # safetensors writes owner-only files
        try:
            os.rename(build, dest)
        except OSError:
            if not dest.is_dir():  # another process finished first: theirs is the same content
                raise
            shutil.rmtree(build, ignore_errors=True)
    except OSError as err:  # disk full, read-only cache: say where, not a traceback
        shutil.rmtree(build, ignore_errors=True)
        raise HubError(
            f"cannot write the converted weights of {repo_id} to {dest.parent} ({err}): set MEMFIT_CACHE to a "
            "writable folder with room for them.",
            "cache",
        ) from None
    except BaseException:
        shutil.rmtree(build, ignore_errors=True)
        raise
    return dest


def _load_tensors(path: Path, repo_id: str) -> dict:
    """The tensors of one pickled file, contiguous, each storage written once.

    Tied weights share one storage in a pickle; safetensors stores each tensor separately and
    refuses shared memory, so an exact alias of an earlier tensor is dropped (transformers ties it
    again on load, as with any safetensors checkpoint it saves) and a partial overlap is copied.
    """
    import pickle

    import torch

    try:
        try:
            state = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as err:
            if "mmap" not in str(err):
                raise
            state = torch.load(str(path), map_location="cpu", weights_only=True)  # legacy (non-zip) format
    except pickle.UnpicklingError as err:
        raise HubError(
            f"{path.name} of {repo_id} holds Python objects other than tensors ({str(err).splitlines()[0]}); memfit "
            "will not unpickle them. Use a repo with safetensors weights.",
            "pickle",
        ) from None
    except (RuntimeError, OSError, EOFError) as err:
        raise HubError(f"{path.name} of {repo_id} is not a readable PyTorch checkpoint ({err}).", "pickle") from None
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise HubError(f"{path.name} of {repo_id} is not a dict of tensors; memfit cannot use it as weights.", "pickle")
    out: dict = {}
    seen: dict[tuple, str] = {}
    storages: set[int] = set()
    for name, tensor in state.items():
        ptr = tensor.untyped_storage().data_ptr() if tensor.numel() else None
        key = (ptr, tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)
        if ptr is not None and key in seen:
            continue  # an alias (tied weights)
        if ptr is not None and ptr in storages:
            tensor = tensor.clone()  # overlaps another tensor without being the same one
        elif ptr is not None:
            seen[key] = name
            storages.add(ptr)
        out[name] = tensor.contiguous()
    return out
