"""Shared pieces of the chat tests: the demo run they talk to (examples/tiny.yaml trained for a few
steps on the CPU, with ``eval_prompts``)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEMO_CONFIG = REPO / "examples" / "tiny.yaml"

#: The prompts the demo run answers at each evaluation (text, and a list of messages).
EVAL_PROMPTS = [
    "What is the capital of France?",
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."}],
]
EVAL_MAX_NEW_TOKENS = 12
DEMO_STEPS = 4


def train_demo(output_dir: Path, **overrides) -> Path:
    """examples/tiny.yaml, cut to ``DEMO_STEPS`` steps, trained into ``output_dir``."""
    from memfit.train.config import load_config
    from memfit.train.recipe import train

    settings = {
        "output_dir": str(output_dir),
        "max_steps": DEMO_STEPS,
        "eval_every": 2,
        "log_every": 1,
        "save_every": 0,
        "eval_prompts": EVAL_PROMPTS,
        "eval_max_new_tokens": EVAL_MAX_NEW_TOKENS,
    }
    settings.update(overrides)
    result = train(load_config(DEMO_CONFIG, settings), progress=False)
    assert result.status == "completed"
    return output_dir
