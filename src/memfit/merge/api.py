"""`merge`: stream a base checkpoint shard by shard, adding a PEFT LoRA adapter on the way."""

from __future__ import annotations

import os
import shutil
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

from .dtypes import CONFIG_NAMES, parse_dtype, torch_dtype
from .errors import MergeError
from .plan import MergePlan, OutputTensor, build_plan, work_code


@dataclass(frozen=True)
class MergeResult:
    """What `merge` wrote."""

    out_dir: Path
    shard_count: int
    tensor_count: int  # tensors written
    merged_tensor_count: int  # tensors that received at least one LoRA delta
    replaced_tensor_count: int  # tensors taken from the adapter (modules_to_save, base_layer copies)
    output_bytes: int  # tensor bytes written (shard files are slightly larger: headers)
    dtype: str | None  # safetensors code forced by --dtype, None when each tensor kept its dtype
    untied_embeddings: bool  # True when tied embeddings had to be written as two tensors
    tokenizer_from: Path  # folder the tokenizer files were copied from
    seconds: float
    removed_leftovers: tuple[Path, ...] = ()  # build folders of earlier merges to --out whose process is gone
    notes: tuple[str, ...] = ()  # what the user should know (folders that may be leftovers)


def parse_device(value: str) -> str:
    """Check a --device value: cpu, cuda or cuda:N (the GPU must exist)."""
    text = (value or "").strip().lower()
    if text == "cpu":
        return "cpu"
    if text == "cuda" or (text.startswith("cuda:") and text[5:].isdigit()):
        import torch

        if not torch.cuda.is_available():
            raise MergeError(f"--device {value!r}: no CUDA GPU is visible to torch. Use --device cpu.")
        index = int(text[5:]) if ":" in text else 0
        if index >= torch.cuda.device_count():
            raise MergeError(
                f"--device {value!r}: only {torch.cuda.device_count()} CUDA device(s) visible (cuda:0 ...)."
            )
        return f"cuda:{index}"
    raise MergeError(f"--device {value!r} is not supported. Use cpu, cuda or cuda:N.")


def merge(
    base: str | os.PathLike,
    adapter: str | os.PathLike,
    out: str | os.PathLike,
    *,
    dtype: str | None = None,
    device: str = "cpu",
    overwrite: bool = False,
    safe: bool = False,
    progress: bool = True,
    revision: str | None = None,
    adapter_revision: str | None = None,
    allow_pickle_weights: bool = False,
) -> MergeResult:
    """Merge a PEFT LoRA adapter into a safetensors base checkpoint, one tensor in memory at a time.

    Args:
        base: Hugging Face checkpoint folder (config.json + model.safetensors or sharded + index),
            or a Hugging Face Hub id (``org/name``), downloaded to huggingface_hub's cache first.
        adapter: PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors), or a
            Hub id.
        out: folder to create. Must be outside `base`; must be empty or absent unless `overwrite`.
        dtype: "bf16", "fp16" or "fp32" to cast every float tensor; None keeps the base's dtypes.
        device: where the LoRA products are computed: "cpu", "cuda" or "cuda:N".
        overwrite: replace a non-empty `out`; the old content is removed only after the new
            checkpoint is complete.
        safe: check every merged or replaced tensor is finite; stop at the first that is not.
        progress: show a progress bar over shards (and over downloads).
        revision, adapter_revision: branch, tag or commit of a Hub ``base`` / ``adapter``.
        allow_pickle_weights: accept Hub repos whose only weights are pickled ``.bin`` files.

    Returns:
        MergeResult describing what was written.

    Raises:
        MergeError: for any bad input, before anything is written where it can be seen up front.
    """
    started = time.perf_counter()
    out_code = parse_dtype(dtype)
    device_name = parse_device(device)
    base_dir, adapter_dir, out_dir = _input_and_output_folders(
        base,
        adapter,
        Path(out),
        overwrite=overwrite,
        revision=revision,
        adapter_revision=adapter_revision,
        allow_pickle=allow_pickle_weights,
        progress=progress,
    )

    from .adapter import read_adapter
    from .base import model_structure, read_base
    from .outdir import check_free_space, remove_stale_builds, tokenizer_source

    checkpoint = read_base(base_dir)
    lora = read_adapter(adapter_dir)
    plan = build_plan(checkpoint, lora, model_structure(base_dir), out_code)
    removed, unsure = remove_stale_builds(out_dir)  # before the space check: they may hold a whole model
    check_free_space(out_dir, plan.output_bytes + 2**20)
    _write_checkpoint(
        plan,
        checkpoint,
        lora,
        out_dir,
        base=base,
        adapter=adapter,
        base_dir=base_dir,
        adapter_dir=adapter_dir,
        out_code=out_code,
        device=device_name,
        safe=safe,
        progress=progress,
    )
    return _merge_result(plan, out_dir, out_code, tokenizer_source(base_dir, adapter_dir), started, removed, unsure)


def _input_and_output_folders(
    base,
    adapter,
    out: Path,
    *,
    overwrite: bool,
    revision: str | None,
    adapter_revision: str | None,
    allow_pickle: bool,
    progress: bool,
) -> tuple[Path, Path, Path]:
    """The base and adapter folders (Hub ids downloaded first) and the output folder, checked:
    the inputs are folders, and ``out`` is outside the base and free unless ``overwrite``."""
    from .outdir import check_paths

    base_dir, adapter_dir = _inputs_from_hub(
        base,
        adapter,
        out,
        revision=revision,
        adapter_revision=adapter_revision,
        allow_pickle=allow_pickle,
        overwrite=overwrite,
        progress=progress,
    )
    if not base_dir.is_dir():
        raise MergeError(
            f"--base {base} is not a folder: pass a Hugging Face checkpoint folder or a Hub id (org/name)."
        )
    if not adapter_dir.is_dir():
        raise MergeError(f"--adapter {adapter} is not a folder: pass a PEFT adapter folder or a Hub id (org/name).")
    return base_dir, adapter_dir, check_paths(base_dir, adapter_dir, out, overwrite)


def _write_checkpoint(
    plan: MergePlan,
    checkpoint,
    lora,
    out_dir: Path,
    *,
    base,
    adapter,
    base_dir: Path,
    adapter_dir: Path,
    out_code: str | None,
    device: str,
    safe: bool,
    progress: bool,
) -> None:
    """Write the merged checkpoint in a build folder next to ``out_dir`` (shards, index, config,
    the tokenizer and other side files, the marker naming ``base`` and ``adapter``), then publish
    it as ``out_dir``."""
    from .outdir import copy_side_files, make_build_folder, publish, write_config, write_marker

    build = make_build_folder(out_dir)
    try:
        _write_shards(plan, checkpoint, lora, build, device, safe, progress)
        if checkpoint.sharded:
            _write_index(plan, build)
        write_config(checkpoint.config, build, CONFIG_NAMES[out_code] if out_code else None, plan.untied)
        copy_side_files(base_dir, adapter_dir, build)
        write_marker(build, str(base), str(adapter), out_code)
        publish(build, out_dir)
    except BaseException:
        # an interrupted or failed merge leaves nothing that looks like a checkpoint
        shutil.rmtree(build, ignore_errors=True)
        raise


def _merge_result(
    plan: MergePlan,
    out_dir: Path,
    out_code: str | None,
    tokenizer_from: Path,
    started: float,
    removed: list[Path],
    unsure: list[Path],
) -> MergeResult:
    """What the merge of ``plan`` wrote, and how long since ``started`` (a ``perf_counter`` reading)
    it took; ``removed`` and ``unsure``: earlier build folders removed, and those that may be leftovers."""
    return MergeResult(
        out_dir=out_dir,
        shard_count=len(plan.shards),
        tensor_count=plan.tensor_count,
        merged_tensor_count=plan.merged_tensor_count,
        replaced_tensor_count=plan.replaced_tensor_count,
        output_bytes=plan.output_bytes,
        dtype=out_code,
        untied_embeddings=plan.untied,
        tokenizer_from=tokenizer_from,
        seconds=time.perf_counter() - started,
        removed_leftovers=tuple(removed),
        notes=tuple(
            f"{path} may be left by an interrupted merge (it has no process id to check): delete it if no merge "
            "to this --out is running"
            for path in unsure
        ),
    )


def _progress(enabled: bool, shard_count: int):
    if not enabled:
        return nullcontext(None)
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    return Progress(
        TextColumn("[bold]merge[/] {task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("shards"),
        TimeElapsedColumn(),
    )


def _write_shards(plan: MergePlan, checkpoint, lora, build: Path, device: str, safe: bool, progress: bool) -> None:
    from .safetensors_stream import StreamingWriter, copy_bytes

    layouts: dict = {}
    with _progress(progress, len(plan.shards)) as bar:
        task = bar.add_task("", total=len(plan.shards)) if bar is not None else None
        for shard, tensors in plan.shards.items():
            if bar is not None:
                bar.update(task, description=shard)
            tmp = build / f"{shard}.tmp"
            writer = StreamingWriter(tmp, [t.spec for t in tensors], {"format": "pt"})
            by_name = {t.name: t for t in tensors}
            try:
                for spec in writer.order:
                    item = by_name[spec.name]
                    source_spec = checkpoint.specs[item.storage.base_key]
                    if not item.storage.touched and item.spec.dtype == source_spec.dtype:
                        # unchanged tensor: a byte copy, no tensor built, no file page mapped
                        source = checkpoint.folder / checkpoint.shard_of[item.storage.base_key]
                        data_start, offsets = _offsets(source, layouts)
                        begin, end = offsets[item.storage.base_key]
                        copy_bytes(writer, item.name, source, data_start + begin, data_start + end)
                        continue
                    value = _produce(item, checkpoint, lora, device, plan.out_dtype)
                    if safe and item.storage.touched:
                        _check_finite(item.name, value)
                    writer.write(item.name, value)
                    # drop the tensor (and the file mapping behind it) before reading the next one
                    del value
                writer.close()
            except BaseException:
                writer.abort()
                raise
            os.replace(tmp, build / shard)
            if bar is not None:
                bar.advance(task)


def _offsets(path: Path, cache: dict):
    from .safetensors_stream import read_offsets

    if path not in cache:
        cache[path] = read_offsets(path)
    return cache[path]


def _read_tensor(path: Path, name: str):
    """One tensor from a shard. Each read opens the file anew: safetensors maps the file, and
    touched pages stay resident until the handle and every tensor from it are gone, so a
    shard-long handle would grow the process to the size of the shard."""
    from safetensors import safe_open

    with safe_open(str(path), "pt", device="cpu") as handle:
        return handle.get_tensor(name)


def _produce(item: OutputTensor, checkpoint, lora, device: str, out_code: str | None):
    from .arith import apply_deltas

    storage = item.storage
    base_code = checkpoint.specs[storage.base_key].dtype
    if storage.adapter_key is not None:
        # PEFT copies saved tensors into parameters of the base's dtype
        value = lora.tensors[storage.adapter_key].to(torch_dtype(base_code))
    else:
        value = _read_tensor(checkpoint.folder / checkpoint.shard_of[storage.base_key], storage.base_key)
    if storage.deltas:
        value = value.to(torch_dtype(work_code(base_code, out_code)))
        value = apply_deltas(value, storage.deltas, lora.tensors, device).to("cpu")
    return value.to(torch_dtype(item.spec.dtype))


def _check_finite(name: str, value) -> None:
    import torch

    if value.dtype.is_floating_point and not bool(torch.isfinite(value).all()):
        raise MergeError(
            f"--safe: merged tensor {name!r} has NaN or infinite values; the adapter is broken. Nothing was written to --out."
        )


def _write_index(plan: MergePlan, build: Path) -> None:
    from .outdir import write_json_atomic

    weight_map = {t.name: shard for shard, tensors in plan.shards.items() for t in tensors}
    index = {"metadata": {"total_size": plan.output_bytes}, "weight_map": dict(sorted(weight_map.items()))}
    write_json_atomic(build / "model.safetensors.index.json", index)


def _inputs_from_hub(
    base,
    adapter,
    out: Path,
    *,
    revision: str | None,
    adapter_revision: str | None,
    allow_pickle: bool,
    overwrite: bool,
    progress: bool,
) -> tuple[Path, Path]:
    """The local folders of ``base`` and ``adapter``: themselves, or their Hub snapshots once downloaded.

    Local paths win over Hub ids of the same spelling. ``--out`` is checked before anything is
    downloaded, and must lie outside huggingface_hub's cache: the merge writes to ``--out`` only,
    never into the cache (whose snapshots it reads, and which cache tools may prune). The small
    adapter is fetched before the large base, so a problem with either shows before the base's
    weights are downloaded.
    """
    from memfit.models.catalog import suggestions
    from memfit.models.hub import HubError, cache_dir, fetch_adapter, fetch_model, is_hub_id, repo_cache_folder

    base_dir, adapter_dir = Path(base).expanduser(), Path(adapter).expanduser()
    base_hub, adapter_hub = is_hub_id(str(base)), is_hub_id(str(adapter))
    for option, value, is_hub in (
        ("--revision", revision, base_hub),
        ("--adapter-revision", adapter_revision, adapter_hub),
    ):
        if value is not None and not is_hub:
            which = "--base" if option == "--revision" else "--adapter"
            raise MergeError(
                f"{option} {value!r} applies only when {which} is a Hugging Face Hub id (org/name); drop it."
            )
    if not (base_hub or adapter_hub):
        return base_dir, adapter_dir
    from .outdir import _is_within, check_paths

    out_r = out.expanduser().resolve()
    if _is_within(out_r, cache_dir().expanduser().resolve()):
        raise MergeError(f"--out {out} is inside the Hugging Face cache ({cache_dir()}): choose a folder outside it.")
    # The repos' cache folders stand in for the folders they will be: --out must not overlap them.
    check_paths(
        repo_cache_folder(str(base)) if base_hub else base_dir,
        repo_cache_folder(str(adapter)) if adapter_hub else adapter_dir,
        out,
        overwrite,
    )
    try:
        if adapter_hub:
            adapter_dir = fetch_adapter(
                str(adapter),
                adapter_revision,
                allow_pickle=allow_pickle,
                opt_in="--allow-pickle-weights",
                progress=progress,
                suggest=suggestions,
            ).folder
    except HubError as err:
        raise MergeError(f"--adapter {adapter}: {err}") from None
    try:
        if base_hub:
            base_dir = fetch_model(
                str(base),
                revision,
                allow_pickle=allow_pickle,
                opt_in="--allow-pickle-weights",
                progress=progress,
                suggest=suggestions,
            ).folder
    except HubError as err:
        raise MergeError(f"--base {base}: {err}") from None
    return base_dir, adapter_dir
