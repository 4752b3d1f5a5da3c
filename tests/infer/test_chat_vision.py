"""memfit chat --image and images in memfit generate's prompts: a vision-language run's processor
renders the pictures into the prompt."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from memfit.infer.batch import PromptsError, generate_file, read_prompts
from memfit.infer.chat import run_chat
from memfit.infer.loading import load_chat_model
from memfit.train.config import load_config
from memfit.train.generation import Sampling
from memfit.train.recipe import train

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
PICTURE = EXAMPLES / "vlm-tiny" / "images" / "red-circle.png"


@pytest.fixture(scope="module")
def vision_run(tmp_path_factory):
    from rich.console import Console

    run_dir = tmp_path_factory.mktemp("vlm") / "run"
    config = load_config(EXAMPLES / "vlm-tiny.yaml", {"output_dir": str(run_dir), "max_steps": 2, "batch_size": 2})
    train(config, progress=False, console=Console(stderr=True, quiet=True))
    return run_dir


def test_chat_shows_the_image_with_the_first_message(vision_run, monkeypatch):
    import memfit.train.generation as generation

    chat_model = load_chat_model(str(vision_run), device="cpu")
    assert chat_model.processor is not None
    seen = []
    real = generation.vision_prompt

    def spy(processor, messages, images):
        inputs = real(processor, messages, images)
        seen.append((messages, inputs))
        return inputs

    monkeypatch.setattr(generation, "vision_prompt", spy)
    lines = iter(["What is it?", "/exit"])
    out = _Out()
    assert (
        run_chat(
            chat_model, Sampling(max_new_tokens=3), images=[str(PICTURE)], read_line=lambda _: next(lines), out=out
        )
        == 0
    )
    ((messages, inputs),) = seen
    assert messages[0]["content"][0] == {"type": "image"}
    assert inputs["pixel_values"].shape == (1, 3, 56, 56)
    assert int((inputs["input_ids"] == 512).sum()) == 16  # the picture's tokens in the prompt


def test_generate_reads_images_beside_the_prompts_file(vision_run, tmp_path):
    shutil.copy(PICTURE, tmp_path / "red.png")
    record = {
        "messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}],
        "images": ["red.png"],
    }
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps(record) + "\n")
    chat_model = load_chat_model(str(vision_run), device="cpu")
    out = tmp_path / "out.jsonl"
    assert (
        generate_file(chat_model, read_prompts(prompts), out, Sampling(max_new_tokens=3), prompts_folder=tmp_path) == 1
    )
    written = json.loads(out.read_text())
    assert written["images"] == ["red.png"] and written["new_tokens"] == 3


def test_a_missing_image_in_the_prompts_names_the_line(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"}], "images": ["gone.png"]}) + "\n")
    with pytest.raises(PromptsError, match=r"line 1: images: no file .*gone.png"):
        read_prompts(prompts)


class _Out:
    def __init__(self) -> None:
        self.text = ""

    def write(self, text: str) -> None:
        self.text += text

    def flush(self) -> None:
        pass
