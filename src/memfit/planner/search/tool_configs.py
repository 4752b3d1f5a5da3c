"""``memfit fit`` of another tool's training config (an Axolotl, LLaMA-Factory or TRL config,
:mod:`memfit.interop`): the search of its model, its method, its effective batch and sequence
length, its other knobs held, and DeepSpeed's buffers where its DeepSpeed config shards the run."""

from __future__ import annotations

import dataclasses
from typing import Any

from memfit.planner.search.request import FitRequest
from memfit.spec import whole_number_value

#: Knobs the search chooses: a config's values of them are where the search starts from, not fixed.
_SEARCHED = ("method", "checkpointing", "optimizer", "grad_accum", "batch_size", "seq_len", "tiling")


def tool_config_request(request: FitRequest) -> tuple[FitRequest, dict[str, Any]]:
    """The search of the tool config ``request.model`` names, and the config as read (a fit's
    ``config``): its model (or ``request.model_override``), its method (unless ``request.methods``),
    its effective batch and sequence length (unless given; even 0, which the search refuses, replaces
    the config's), its other knobs held with the request's knobs in their place."""
    from memfit.interop import read_tool_config

    given = dict(request.knobs, **({"gpus": request.gpus} if request.gpus is not None else {}))
    tool = read_tool_config(str(request.model), model=request.model_override)
    knobs, dropped = tool.knobs_for(given)
    config_batch = int(knobs.get("batch_size", 1)) * int(knobs.get("grad_accum", 1))
    fixed = {k: v for k, v in knobs.items() if k not in _SEARCHED}
    gpus = fixed.pop("gpus", None)
    # Adapters' optimizer states are small: the config's optimizer is kept (full fine-tuning's is searched).
    optimizers = {m: (knobs["optimizer"],) for m in ("lora", "qlora", "lora-8bit")} if knobs.get("optimizer") else None
    count = whole_number_value(gpus or 1)  # not a whole number: the search's checks name it
    sharded = isinstance(count, int) and count > 1 and fixed.get("shard") == tool.shard
    search = dataclasses.replace(
        request,
        model=tool.model,
        model_override=None,
        revision=request.revision or tool.revision,
        batch_size=config_batch if request.batch_size is None else request.batch_size,
        seq_len=knobs.get("seq_len") if request.seq_len is None else request.seq_len,
        methods=request.methods or (knobs.get("method", "lora"),),
        gpus=gpus,
        knobs=fixed,
        optimizers=optimizers,
        deepspeed=tool.zero if sharded else None,
    )
    config = tool.to_dict(given=given)
    config["not_modelled"] += [f.to_dict() for f in dropped]
    return search, config
