"""A DeepSpeed config, as the Hugging Face Trainer runs it: the ZeRO settings that decide memory.

Axolotl, LLaMA-Factory and the Trainer name a DeepSpeed JSON (``deepspeed: ds_z3.json``); it is
read here (relative to the training config, then to the working directory) into
:class:`ZeroSettings`: the ZeRO stage, optimizer and parameter offload, and the bucket sizes the
planner counts per rank (:mod:`memfit.planner.sharding`). ``"auto"`` values are resolved as
transformers' ``integrations/deepspeed.py`` resolves them (``HfTrainerDeepSpeedConfig``): bucket
sizes from the model's ``hidden_size`` (:meth:`ZeroSettings.resolved`), batch sizes and precision
from the training arguments. Defaults are DeepSpeed's (``runtime/zero/config.py``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from memfit.interop.keys import as_bool, truthy
from memfit.json_form import JsonForm

#: DeepSpeed's defaults (``DeepSpeedZeroConfig``), in elements.
DEFAULT_REDUCE_BUCKET = 500_000_000
DEFAULT_ALLGATHER_BUCKET = 500_000_000
DEFAULT_PREFETCH_BUCKET = 50_000_000
DEFAULT_PERSISTENCE_THRESHOLD = 100_000
DEFAULT_MAX_LIVE_PARAMETERS = 1_000_000_000
DEFAULT_MAX_REUSE_DISTANCE = 1_000_000_000

#: ``zero_optimization`` keys memfit reads; the others listed here do not decide a step's memory.
ZERO_MEMORY_KEYS = (
    "stage",
    "offload_optimizer",
    "offload_param",
    "reduce_bucket_size",
    "allgather_bucket_size",
    "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold",
    "stage3_max_live_parameters",
    "stage3_max_reuse_distance",
    "overlap_comm",
    "contiguous_gradients",
)
ZERO_QUIET_KEYS = (
    "allgather_partitions",
    "reduce_scatter",
    "round_robin_gradients",
    "load_from_fp32_weights",
    "elastic_checkpoint",
    "ignore_unused_parameters",
    "legacy_stage1",
    "stage3_gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save",
    "gather_16bit_weights_on_model_save",
    "use_multi_rank_bucket_allreduce",
    "stage3_use_all_reduce_for_fetch_params",
    "stage3_allgather_sequential",
    "stage3_module_granularity_threshold",
    "memory_efficient_linear",
    "cpu_offload",
    "cpu_offload_param",
    "cpu_offload_use_pin_memory",
    "sub_group_size",
    "log_trace_cache_warnings",
    "override_module_apply",
    "pipeline_loading_checkpoint",
    "use_all_reduce_for_fetch_params",
    "mics_hierarchical_params_gather",
    "zeropp_loco_param",
)
#: ``zero_optimization`` keys that decide memory and are not modelled, and why.
ZERO_UNMODELLED = {
    "zero_hpz_partition_size": "ZeRO++ hierarchical partitioning keeps a second copy of the weights' partitions per node",
    "zero_quantized_weights": "ZeRO++ quantized weight communication (int8 all-gather buffers)",
    "zero_quantized_nontrainable_weights": "ZeRO++ keeps frozen weights quantized",
    "zero_quantized_gradients": "ZeRO++ quantized gradient communication",
    "mics_shard_size": "MiCS shards over sub-groups of ranks, not all of them",
}
#: Top-level DeepSpeed keys that do not decide a step's memory (the rest of the file).
TOP_QUIET_KEYS = (
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "steps_per_print",
    "wall_clock_breakdown",
    "zero_allow_untested_optimizer",
    "scheduler",
    "prescale_gradients",
    "gradient_predivide_factor",
    "communication_data_type",
    "dump_state",
    "flops_profiler",
    "comms_logger",
    "tensorboard",
    "wandb",
    "csv_monitor",
    "checkpoint",
    "elasticity",
    "aio",
    "amp",
    "zero_force_ds_cpu_optimizer",
    "activation_checkpointing",
    "sparse_gradients",
    "seq_parallel_communication_data_type",
    "torch_autocast",
    "compile",
    "monitor_config",
    "timers",
    "memory_breakdown",
    "disable_allgather",
    "autotuning",
)


class DeepSpeedError(ValueError):
    """A DeepSpeed config that cannot be read: the message names the file and the key."""


@dataclass(frozen=True)
class ZeroSettings(JsonForm):
    """What a DeepSpeed config says about memory. Bucket sizes are in elements (DeepSpeed's unit);
    None where the config says ``"auto"`` (see :meth:`resolved`)."""

    path: str
    stage: int = 0
    offload_optimizer: bool = False
    offload_param: bool = False
    reduce_bucket_elements: int | None = DEFAULT_REDUCE_BUCKET
    allgather_bucket_elements: int | None = DEFAULT_ALLGATHER_BUCKET
    prefetch_bucket_elements: int | None = DEFAULT_PREFETCH_BUCKET
    persistence_threshold_elements: int | None = DEFAULT_PERSISTENCE_THRESHOLD
    max_live_parameters: int = DEFAULT_MAX_LIVE_PARAMETERS
    max_reuse_distance: int = DEFAULT_MAX_REUSE_DISTANCE
    overlap_comm: bool | None = None  # None: DeepSpeed's default (on for stage 3 only)
    contiguous_gradients: bool = True
    bf16: Any = None  # the file's bf16.enabled / fp16.enabled: True, False, "auto" or None (absent)
    fp16: Any = None
    optimizer_type: str | None = None  # DeepSpeed's own optimizer block, when the file has one
    unmodelled: tuple[tuple[str, Any, str], ...] = field(default_factory=tuple)
    unknown: tuple[str, ...] = field(default_factory=tuple)

    @property
    def overlaps_comm(self) -> bool:
        return self.stage == 3 if self.overlap_comm is None else self.overlap_comm

    def resolved(self, hidden_size: int) -> ZeroSettings:
        """``"auto"`` bucket sizes filled in as transformers fills them (``trainer_config_finalize``):
        ``reduce_bucket_size`` hidden_size², and for stage 3 ``stage3_prefetch_bucket_size``
        0.9 x hidden_size² and ``stage3_param_persistence_threshold`` 10 x hidden_size. (For stages 1
        and 2 transformers leaves the stage-3 keys alone: DeepSpeed does not read them there.)"""
        return replace(
            self,
            reduce_bucket_elements=self.reduce_bucket_elements
            if self.reduce_bucket_elements is not None
            else hidden_size * hidden_size,
            prefetch_bucket_elements=(
                self.prefetch_bucket_elements
                if self.prefetch_bucket_elements is not None
                else int(0.9 * hidden_size * hidden_size)
                if self.stage == 3
                else DEFAULT_PREFETCH_BUCKET
            ),
            persistence_threshold_elements=(
                self.persistence_threshold_elements
                if self.persistence_threshold_elements is not None
                else 10 * hidden_size
                if self.stage == 3
                else DEFAULT_PERSISTENCE_THRESHOLD
            ),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "stage": self.stage,
            "offload_optimizer": self.offload_optimizer,
            "offload_param": self.offload_param,
            "reduce_bucket_size": self.reduce_bucket_elements,
            "allgather_bucket_size": self.allgather_bucket_elements,
            "stage3_prefetch_bucket_size": self.prefetch_bucket_elements,
            "stage3_param_persistence_threshold": self.persistence_threshold_elements,
            "stage3_max_live_parameters": self.max_live_parameters,
            "stage3_max_reuse_distance": self.max_reuse_distance,
            "overlap_comm": self.overlaps_comm,
            "contiguous_gradients": self.contiguous_gradients,
        }


def find_deepspeed_file(value: str, config_folder: Path) -> Path:
    """The DeepSpeed JSON a training config names: relative to the config's folder, then to the
    working directory (as the tools, started from there, would open it)."""
    named = Path(value).expanduser()
    candidates = [named] if named.is_absolute() else [config_folder / named, Path.cwd() / named]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    folder = next((c for c in candidates if c.is_dir()), None)
    if folder is not None:
        inside = sorted(p.name for p in folder.glob("*.json"))[:3]
        hint = f" (it holds {', '.join(inside)})" if inside else ""
        raise DeepSpeedError(
            f"{value!r} is a folder ({str(folder)!r}){hint}; a DeepSpeed JSON file is expected: point it at "
            "the file, e.g. ds_z3_config.json"
        )
    raise DeepSpeedError(
        f"{value!r} does not exist (looked in {str(config_folder)!r} and the working directory); "
        "point it at your DeepSpeed JSON"
    )


def load_deepspeed(value: Any, config_folder: Path) -> tuple[dict[str, Any], str]:
    """The DeepSpeed config a ``deepspeed`` key gives (a path, or the config inline) and where it came from."""
    if isinstance(value, Mapping):
        return dict(value), "inline"
    if not isinstance(value, str) or not value.strip():
        raise DeepSpeedError(f"{value!r} is not a path to a DeepSpeed JSON")
    path = find_deepspeed_file(value.strip(), config_folder)
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as err:
        raise DeepSpeedError(f"{str(path)!r} cannot be read: {err}") from None
    except json.JSONDecodeError as err:
        raise DeepSpeedError(f"{str(path)!r} is not valid JSON (line {err.lineno}: {err.msg})") from None
    if not isinstance(data, dict):
        raise DeepSpeedError(f"{str(path)!r} is not a DeepSpeed config (a JSON object)")
    return data, str(path)


def read_zero(data: Mapping[str, Any], where: str) -> ZeroSettings:
    """The memory settings of DeepSpeed config ``data`` (read from ``where``); a bad value raises
    :class:`DeepSpeedError` naming the key."""
    zero = data.get("zero_optimization") or {}
    if not isinstance(zero, Mapping):
        raise DeepSpeedError(f"{where}: zero_optimization: {zero!r} is not an object")

    def number(name: str, default: int | None, *, auto: bool = False) -> int | None:
        value = zero.get(name, default)
        if auto and isinstance(value, str) and value.strip().lower() == "auto":
            return None
        try:
            if isinstance(value, bool):
                raise ValueError
            number = float(value)
            if number < 0 or not number.is_integer():
                raise ValueError
            return int(number)
        except (TypeError, ValueError):
            raise DeepSpeedError(
                f"{where}: zero_optimization.{name}: {value!r} is not a whole number of elements"
                + (' or "auto"' if auto else "")
            ) from None

    stage = number("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise DeepSpeedError(f"{where}: zero_optimization.stage: {stage} is not one of 0, 1, 2, 3")
    unmodelled = []
    offload = {}
    for name in ("offload_optimizer", "offload_param"):
        block = zero.get(name)
        device = (block.get("device", "none") if isinstance(block, Mapping) else "none") or "none"
        if str(device).lower() not in ("none", "cpu", "nvme"):
            raise DeepSpeedError(f"{where}: zero_optimization.{name}.device: {device!r} is not one of none, cpu, nvme")
        offload[name] = str(device).lower() != "none"
        ratio = block.get("ratio", 1.0) if isinstance(block, Mapping) else 1.0
        if offload[name] and ratio not in (1, 1.0):
            unmodelled.append(
                (
                    f"zero_optimization.{name}.ratio",
                    ratio,
                    "a part of the optimizer states offloaded: planned as all of them",
                )
            )
    if offload["offload_param"] and stage != 3:
        raise DeepSpeedError(
            f"{where}: zero_optimization.offload_param: DeepSpeed offloads parameters with stage 3 only (stage is {stage})"
        )
    for name, why in ZERO_UNMODELLED.items():
        if name in zero and truthy(zero[name]) and zero[name] not in (1, "1"):
            unmodelled.append((f"zero_optimization.{name}", zero[name], why))

    def flag(name: str, default: bool | None) -> bool | None:
        if name not in zero:
            return default
        try:
            return as_bool(zero[name])
        except ValueError as err:
            raise DeepSpeedError(f"{where}: zero_optimization.{name}: {err}") from None

    known = set(ZERO_MEMORY_KEYS) | set(ZERO_QUIET_KEYS) | set(ZERO_UNMODELLED)
    unknown = [f"zero_optimization.{k}" for k in zero if k not in known]
    top_known = set(TOP_QUIET_KEYS) | {"zero_optimization", "bf16", "fp16", "bfloat16", "optimizer", "data_types"}
    unknown += [k for k in data if k not in top_known]
    optimizer = data.get("optimizer")
    optimizer_type = str(optimizer.get("type")) if isinstance(optimizer, Mapping) and optimizer.get("type") else None
    grad_dtype = (
        (data.get("data_types") or {}).get("grad_accum_dtype") if isinstance(data.get("data_types"), Mapping) else None
    )
    if grad_dtype:
        unmodelled.append(
            ("data_types.grad_accum_dtype", grad_dtype, "gradients accumulated in another dtype than the weights'")
        )
    return ZeroSettings(
        path=where,
        stage=stage,
        offload_optimizer=offload["offload_optimizer"],
        offload_param=offload["offload_param"],
        reduce_bucket_elements=number("reduce_bucket_size", DEFAULT_REDUCE_BUCKET, auto=True),
        allgather_bucket_elements=number("allgather_bucket_size", DEFAULT_ALLGATHER_BUCKET, auto=True),
        prefetch_bucket_elements=number("stage3_prefetch_bucket_size", DEFAULT_PREFETCH_BUCKET, auto=True),
        persistence_threshold_elements=number(
            "stage3_param_persistence_threshold", DEFAULT_PERSISTENCE_THRESHOLD, auto=True
        ),
        max_live_parameters=number("stage3_max_live_parameters", DEFAULT_MAX_LIVE_PARAMETERS),
        max_reuse_distance=number("stage3_max_reuse_distance", DEFAULT_MAX_REUSE_DISTANCE),
        overlap_comm=flag("overlap_comm", None),
        contiguous_gradients=bool(flag("contiguous_gradients", True)),
        bf16=_enabled(data.get("bf16", data.get("bfloat16"))),
        fp16=_enabled(data.get("fp16")),
        optimizer_type=optimizer_type,
        unmodelled=tuple(unmodelled),
        unknown=tuple(unknown),
    )


def _enabled(block: Any) -> Any:
    """A precision block's ``enabled``: True, False, "auto", or None when the block is absent."""
    if not isinstance(block, Mapping):
        return None
    value = block.get("enabled", False)
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    return truthy(value)


def shard_mode(zero: ZeroSettings) -> str:
    """memfit's shard mode for a ZeRO stage: ddp for stage 0 (plain data parallel), zero1, zero2,
    and for stage 3 zero3, or fsdp-offload when parameters and optimizer states are both offloaded
    (the same placement: weights, gradients and states in host memory, the step on the CPU)."""
    if zero.stage == 3 and zero.offload_param and zero.offload_optimizer:
        return "fsdp-offload"
    return {0: "ddp", 1: "zero1", 2: "zero2", 3: "zero3"}[zero.stage]
