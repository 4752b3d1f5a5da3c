"""The parameter layout's 4-bit base under sharding: whole on every rank for memfit's trainer, sharded
and gathered for the hf recipe's FSDP and ZeRO-3; its quantization state whole in both."""

from __future__ import annotations

import pytest

from memfit.planner.layout import param_layout
from memfit.planner.sharding import per_rank_categories
from memfit.spec import make_spec

HIDDEN, INNER, LAYERS, VOCAB = 256, 512, 2, 1000
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": HIDDEN,
    "intermediate_size": INNER,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": VOCAB,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}
# Every decoder linear: q, k, v, o (HIDDEN x HIDDEN) and gate, up, down (HIDDEN x INNER).
ATTENTION, MLP = HIDDEN * HIDDEN, HIDDEN * INNER
PACKED = LAYERS * (4 * ATTENTION + 3 * MLP) // 2  # two 4-bit values a byte


def _state(elements: int) -> int:
    """bitsandbytes' double-quantized state: a uint8 absmax per 64 values, an fp32 absmax per 256 of
    those and an fp32 offset."""
    blocks = elements // 64
    return blocks + 4 * (blocks // 256) + 4


STATE = LAYERS * (4 * _state(ATTENTION) + 3 * _state(MLP))
ROOT = 2 * VOCAB * HIDDEN * 2 + HIDDEN * 2  # bf16 embeddings, head and final norm


def _layout(recipe: str, shard: str = "fsdp"):
    upcast = {"kbit_upcast": False} if recipe == "hf" else {}
    spec = make_spec(method="qlora", targets="q_proj", rank=8, gpus=2, shard=shard, recipe=recipe, **upcast)
    return param_layout(TINY_LLAMA, spec, remember=False)


def test_memfit_keeps_the_packed_base_and_its_state_whole_on_every_rank():
    layout = _layout("memfit")
    assert layout.whole_bytes(False) == PACKED + STATE
    # a gathered layer holds the norms (and the adapter), never the packed weights
    assert layout.layer_param_bytes < PACKED // LAYERS
    frozen = layout.shard_bytes(False, 2)
    assert frozen - (PACKED + STATE) == pytest.approx(ROOT / 2 + LAYERS * 2 * HIDDEN, abs=64)


@pytest.mark.parametrize("shard", ["fsdp", "zero3"])
def test_the_hf_recipe_shards_and_gathers_the_packed_base_and_keeps_its_state_whole(shard):
    layout = _layout("hf", shard)
    assert layout.whole_bytes(False) == STATE
    # a rank holds half of the packed bytes (and of the rest); a gathered layer holds all of its own
    assert layout.shard_bytes(False, 2) == pytest.approx(STATE + (PACKED + ROOT) / 2 + LAYERS * 2 * HIDDEN, abs=64)
    assert layout.layer_param_bytes >= PACKED // LAYERS


@pytest.mark.parametrize("recipe, on_gpu", [("memfit", PACKED + STATE), ("hf", STATE)])
def test_cpu_offload_leaves_what_fsdp_does_not_manage_on_the_gpu(recipe, on_gpu):
    layout = _layout(recipe, "fsdp-offload")
    frozen = layout.total_bytes(False)
    single = {"weights": frozen, "trainable": 0, "gradients": 0, "optimizer": 0, "activations": 0, "temporaries": 0}
    cats = per_rank_categories(single, "forward", shard="fsdp-offload", gpus=2, layout=layout)
    assert cats["weights"] == on_gpu
