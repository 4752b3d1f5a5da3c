"""Dataset repos on the local Hub (tests/models/local_hub.py), and ``datasets`` pointed at it.

``datasets`` reads HF_ENDPOINT, HF_HOME and HF_HUB_OFFLINE once, at import, into
``datasets.config``; :func:`point_datasets_at` sets the environment (for child processes) and those
values (for this process), beside what :func:`hub_repos.point_at` sets for huggingface_hub.
"""

from __future__ import annotations

import io
import json
import socket
import sys
import threading
from pathlib import Path

TESTS = Path(__file__).resolve().parents[2]
for folder in ("models", "train"):
    if str(TESTS / folder) not in sys.path:
        sys.path.insert(0, str(TESTS / folder))

from hub_repos import point_at  # noqa: E402
from local_hub import LocalHub  # noqa: E402
from trainer_helpers import DEMO_DATA, REPO  # noqa: E402

DEMO_PAIRS = REPO / "src" / "memfit" / "assets" / "data" / "tiny-preferences.jsonl"

#: Chat records in data/train.jsonl and data/test.jsonl (splits named by the files, as datasets infers them).
CHAT = "memfit-test/tiny-chat"
#: Question/answer pairs in Parquet: two subsets (easy, hard) declared in the README, split train_sft.
PAIRS = "memfit-test/qa-pairs"
#: Preference pairs (TRL's prompt / chosen / rejected, message lists) in Parquet: the shipped demo's first 48.
PREFERENCES = "memfit-test/tiny-preferences"
#: Questions about the six pictures of examples/vlm-tiny in TRL's vision format, in Parquet: image
#: parts in the messages, an images column of datasets Image features holding each picture's bytes.
VISION = "memfit-test/tiny-vision"
VISION_EXAMPLE = REPO / "examples" / "vlm-tiny"
#: The chat records again, gated (granted to GRANTED_TOKEN).
GATED_DATA = "memfit-test/gated-chat"
GRANTED_TOKEN = "hf_granted_token"

PAIRS_README = b"""---
configs:
- config_name: easy
  data_files:
  - split: train_sft
    path: easy/train_sft.parquet
- config_name: hard
  data_files:
  - split: train_sft
    path: hard/train_sft.parquet
---
# qa-pairs
"""


def demo_rows(count: int, start: int = 0) -> list[dict]:
    lines = DEMO_DATA.read_text(encoding="utf-8").splitlines()[start : start + count]
    return [json.loads(line) for line in lines]


def demo_pairs(count: int) -> list[dict]:
    lines = DEMO_PAIRS.read_text(encoding="utf-8").splitlines()[:count]
    return [json.loads(line) for line in lines]


def jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def pairs(count: int, prefix: str) -> list[dict]:
    """Question/answer rows made from the demo conversations (their first user turn and reply)."""
    rows = []
    for row in demo_rows(count):
        turns = row["messages"]
        question = next(t["content"] for t in turns if t["role"] == "user")
        answer = next(t["content"] for t in turns if t["role"] == "assistant")
        rows.append({"question": f"{prefix}{question}", "answer": answer, "id": len(rows)})
    return rows


def parquet(rows: list[dict]) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    buffer = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buffer)
    return buffer.getvalue()


def vision_parquet() -> bytes:
    """examples/vlm-tiny's records as a Hub dataset holds them: each picture's bytes in the row."""
    import tempfile

    import datasets

    rows = []
    for line in (VISION_EXAMPLE / "data.jsonl").read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        pictures = [{"bytes": (VISION_EXAMPLE / path).read_bytes(), "path": Path(path).name} for path in row["images"]]
        rows.append({"messages": row["messages"], "images": pictures})
    table = datasets.Dataset.from_list(rows).cast_column("images", datasets.Sequence(datasets.Image()))
    with tempfile.TemporaryDirectory() as folder:
        table.to_parquet(f"{folder}/train.parquet")
        return Path(f"{folder}/train.parquet").read_bytes()


def add_dataset_repos(server: LocalHub) -> dict[str, str]:
    """The dataset repos (see the names above); returns each repo's commit on main."""
    chat = {"data/train.jsonl": jsonl(demo_rows(64)), "data/test.jsonl": jsonl(demo_rows(8, start=64))}
    return {
        CHAT: server.add_commit(CHAT, chat, repo_type="dataset"),
        PAIRS: server.add_commit(
            PAIRS,
            {
                "README.md": PAIRS_README,
                "easy/train_sft.parquet": parquet(pairs(40, "")),
                "hard/train_sft.parquet": parquet(pairs(40, "Think hard: ")),
            },
            repo_type="dataset",
        ),
        PREFERENCES: server.add_commit(
            PREFERENCES, {"data/train.parquet": parquet(demo_pairs(48))}, repo_type="dataset"
        ),
        VISION: server.add_commit(VISION, {"data/train.parquet": vision_parquet()}, repo_type="dataset"),
        GATED_DATA: server.add_commit(
            GATED_DATA, chat, repo_type="dataset", gated=True, granted_tokens=(GRANTED_TOKEN,)
        ),
    }


def point_datasets_at(
    monkeypatch, endpoint: str, home: Path, *, token: str | None = None, offline: bool = False
) -> None:
    """huggingface_hub and datasets pointed at ``endpoint``, with their caches in ``home``."""
    import datasets

    point_at(monkeypatch, endpoint, home, token=token, offline=offline)
    config = datasets.config
    monkeypatch.setenv("HF_DATASETS_CACHE", str(home / "datasets"))
    monkeypatch.setattr(config, "HF_ENDPOINT", endpoint)
    monkeypatch.setattr(config, "HUB_DATASETS_URL", endpoint + "/datasets/{repo_id}/resolve/{revision}/{path}")
    monkeypatch.setattr(config, "HF_CACHE_HOME", str(home))
    monkeypatch.setattr(config, "HF_DATASETS_CACHE", home / "datasets")
    monkeypatch.setattr(config, "HF_MODULES_CACHE", home / "modules")
    monkeypatch.setattr(config, "DOWNLOADED_DATASETS_PATH", home / "datasets" / "downloads")
    monkeypatch.setattr(config, "EXTRACTED_DATASETS_PATH", home / "datasets" / "downloads" / "extracted")
    set_datasets_offline(monkeypatch, offline)
    # The Hub's dataset viewer (a Parquet export of public datasets) has no local counterpart.
    monkeypatch.setattr(config, "USE_PARQUET_EXPORT", False)


def set_datasets_offline(monkeypatch, offline: bool = True) -> None:
    import datasets
    from hub_repos import set_offline

    set_offline(monkeypatch, offline)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", offline)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", offline)


class FailingHub:
    """A Hub that does not work, on 127.0.0.1: every connection is answered with ``503 Service
    Unavailable`` (``mode="503"``) or closed before any answer (``mode="drop"``), and counted, so a
    test can say how many times a client tried (huggingface_hub retries both, with waits between)."""

    def __init__(self, mode: str = "503") -> None:
        self.mode = mode
        self.connections = 0
        self._socket = socket.socket()
        self._socket.bind(("127.0.0.1", 0))
        self._socket.listen(16)
        self.endpoint = f"http://127.0.0.1:{self._socket.getsockname()[1]}"
        threading.Thread(target=self._serve, name="failing-hub", daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                connection, _ = self._socket.accept()
            except OSError:  # closed
                return
            self.connections += 1
            with connection:
                if self.mode == "503":
                    connection.recv(65536)
                    connection.sendall(
                        b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                    )

    def close(self) -> None:
        self._socket.close()
