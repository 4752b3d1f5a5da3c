"""memfit fit of another tool's config (memfit.planner.search.tool_configs): the request the search
makes of it keeps the config's method, effective batch, length and knobs, puts the request's own in
their place, and keeps what was read."""

from __future__ import annotations

import json

from memfit.planner.search.request import FitRequest
from memfit.planner.search.tool_configs import tool_config_request


def _trl(tmp_path, tiny_llama) -> str:
    """A TRL SFT config of the tiny model: LoRA r=8, 128 tokens, micro-batch 2 x 2 accumulated."""
    folder = tmp_path / "tiny"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(tiny_llama))
    path = tmp_path / "sft.yaml"
    path.write_text(
        f"model_name_or_path: {folder}\nuse_peft: true\nlora_r: 8\nmax_length: 128\n"
        "per_device_train_batch_size: 2\ngradient_accumulation_steps: 2\ngradient_checkpointing: true\n"
    )
    return str(path)


def test_the_config_s_method_batch_length_and_knobs_are_kept(tmp_path, tiny_llama):
    config = _trl(tmp_path, tiny_llama)
    search, read = tool_config_request(FitRequest(config, budget="2GiB", max_seq_len=False, workers=1, exact=True))
    assert search.model == str(tmp_path / "tiny") and search.methods == ("lora",)
    assert search.batch_size == 4 and search.seq_len == 128  # micro-batch x accumulation: the effective batch
    assert search.knobs["rank"] == 8 and search.knobs["recipe"] == "hf"
    assert not set(search.knobs) & {
        "method",
        "checkpointing",
        "optimizer",
        "grad_accum",
        "batch_size",
        "seq_len",
        "tiling",
    }
    assert (search.budget, search.max_seq_len, search.workers, search.exact) == ("2GiB", False, 1, True)
    assert search.gpus is None and search.deepspeed is None
    # An adapter's optimizer states are small: the config's optimizer (the Trainer's default here) is
    # the one its methods try.
    assert search.optimizers == {m: ("adamw",) for m in ("lora", "qlora", "lora-8bit")}
    assert read["tool"] == "trl" and read["given"] == {}


def test_what_the_request_gives_replaces_the_config_s(tmp_path, tiny_llama):
    config = _trl(tmp_path, tiny_llama)
    search, read = tool_config_request(
        FitRequest(
            config,
            budget="2GiB",
            batch_size=8,
            seq_len=256,
            methods=("qlora",),
            gpus=2,
            knobs={"rank": 16, "shard": "fsdp"},
        )
    )
    assert (search.batch_size, search.seq_len, search.methods, search.gpus) == (8, 256, ("qlora",), 2)
    assert search.knobs["rank"] == 16 and search.knobs["shard"] == "fsdp"
    assert read["given"] == {"rank": 16, "shard": "fsdp", "gpus": 2}
