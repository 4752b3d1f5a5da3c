"""What the page's tests share: a tiny model's config, a real `memfit ui` server, chromium's flags."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

#: A llama-shaped model that plans in a fraction of a second; named by its folder, as the command
#: line names a config.json, and by ``_name_or_path``, as the planner names a dropped config.
TINY = {
    "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 1024,
    "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2, "_name_or_path": "tiny",
}

#: The flags that start Debian's chromium here: no sandbox (root in a container), no GPU, no
#: network of its own (no QUIC, no background fetches, no component updates, no sync).
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def chromium_path() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


class Server:
    """A `memfit ui --port 0` process, its address and its process id."""

    def __init__(self, *args: str, env: dict | None = None):
        self.process = subprocess.Popen([sys.executable, "-m", "memfit", "ui", "--port", "0", *args],
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                        env={**os.environ, **(env or {})})
        line = self.process.stdout.readline()  # the address, printed once the socket listens
        if not line.startswith("memfit ui: "):
            self.stop()
            raise RuntimeError(f"memfit ui did not start: {line!r} {self.process.stderr.read()}")
        self.url = line.split()[2]

    def stop(self) -> str:
        self.process.terminate()
        try:
            _, err = self.process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            _, err = self.process.communicate()
        return err
