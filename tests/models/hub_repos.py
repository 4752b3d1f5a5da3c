"""The Hub tests' repos and settings: repo names, the tiny repos (built once), huggingface_hub pointed at a local Hub."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from local_hub import LocalHub

TESTS = Path(__file__).resolve().parents[1]
for helpers in ("train", "merge"):  # trainer_helpers (tiny pretrained model), merge_helpers (PEFT adapter)
    if str(TESTS / helpers) not in sys.path:
        sys.path.insert(0, str(TESTS / helpers))

MODEL = "memfit-test/tiny-llama"
GATED = "memfit-test/gated-llama"
PICKLED = "memfit-test/tiny-llama-bin"
ADAPTER = "memfit-test/tiny-adapter"
REMOTE_CODE = "memfit-test/custom-arch"
#: A catalog entry's source repo (SOURCES.md: smollm2-135m), served gated so the Hub cannot answer.
CATALOG_SOURCE = "HuggingFaceTB/SmolLM2-135M"
GRANTED_TOKEN = "hf_granted_token"
LONG_CONTEXT = 256  # max_position_embeddings on the "long-context" branch; main has 128


@dataclass
class Built:
    """The tiny repos, as folders on disk (the same bytes the local Hub serves)."""

    model: Path  # safetensors, two shards + index, tokenizer, generation config
    adapter: Path  # PEFT LoRA adapter for it
    pickled: Path  # the same model as one pytorch_model.bin (tied weights aliased, as torch.save writes them)
    main_config: dict
    branch_config: dict


def build_repos(root: Path) -> Built:
    """The tiny model (two safetensors shards), its adapter and a pickled copy, in folders under ``root``."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from merge_helpers import save_adapter
    from trainer_helpers import save_tiny_pretrained

    model = save_tiny_pretrained(root / "model", max_shard_size="100KB")
    main_config = json.loads((model / "config.json").read_text())
    main_config["max_position_embeddings"] = 128
    (model / "config.json").write_text(json.dumps(main_config, indent=2))
    branch_config = dict(main_config, max_position_embeddings=LONG_CONTEXT)
    adapter = save_adapter(
        model, root / "adapter", torch.float32, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]
    )

    import transformers

    pickled = root / "pickled"
    pickled.mkdir()
    tiny = transformers.AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
    torch.save(tiny.state_dict(), pickled / "pytorch_model.bin")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (pickled / name).write_bytes((model / name).read_bytes())
    return Built(model, adapter, pickled, main_config, branch_config)


@dataclass
class HubFixture:
    server: LocalHub
    cache: Path  # HF_HUB_CACHE
    main: str  # commit of MODEL's main branch
    branch: str  # commit of MODEL's "long-context" branch


def point_at(monkeypatch, endpoint: str, home: Path, *, token: str | None = None, offline: bool = False) -> None:
    """Point huggingface_hub at ``endpoint`` with cache ``home``/hub, and memfit's cache inside ``home``.

    huggingface_hub reads HF_ENDPOINT, HF_HOME, HF_HUB_CACHE and HF_HUB_OFFLINE once, at import, into
    ``huggingface_hub.constants``; its functions read those constants when called, so both the
    environment (for child processes) and the constants (for this process) are set. HF_TOKEN is
    read on every call.
    """
    from huggingface_hub import constants

    home.mkdir(parents=True, exist_ok=True)
    env = {
        "HF_ENDPOINT": endpoint,
        "HF_HOME": str(home),
        "HF_HUB_CACHE": str(home / "hub"),
        "HF_HUB_OFFLINE": "1" if offline else "0",
        "MEMFIT_CACHE": str(home / "memfit"),
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "NO_PROXY": "127.0.0.1,localhost",
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    for key in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_DISABLE_IMPLICIT_TOKEN"):
        monkeypatch.delenv(key, raising=False)
    if token:
        monkeypatch.setenv("HF_TOKEN", token)
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HOME", str(home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(home / "token"))  # never a real login's token
    if hasattr(constants, "HF_STORED_TOKENS_PATH"):
        monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(home / "stored_tokens"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)


def set_offline(monkeypatch, offline: bool = True) -> None:
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1" if offline else "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)


def hf_home_is_a_file(monkeypatch, home: Path) -> Path:
    """Make ``home`` a file and HF_HOME point at it, as the user sets it and as huggingface_hub reads
    it (its constants); HF_HUB_CACHE is left to follow HF_HOME."""
    from huggingface_hub import constants

    home.write_text("not a folder\n")
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setattr(constants, "HF_HOME", str(home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(home / "token"))
    return home
