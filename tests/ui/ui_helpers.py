"""What the page's tests share: a tiny model's config, a real `memfit ui` server, chromium's flags."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

#: A llama-shaped model that plans in a fraction of a second; named by its folder, as the command
#: line names a config.json, and by ``_name_or_path``, as the planner names a dropped config.
TINY = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 1024,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
    "_name_or_path": "tiny",
}

#: The flags that start Debian's chromium here: no sandbox (root in a container), no GPU, no
#: network of its own (no QUIC, no background fetches, no component updates, no sync).
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def chromium_path() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


class Server:
    """A `memfit ui --port 0` process, its address and its process id."""

    def __init__(self, *args: str, env: dict | None = None):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "memfit", "ui", "--port", "0", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
        )
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


#: A search that takes far longer than anything here waits for (tens of plans of an 8B model, on
#: up to 8 GPUs, with the plan cache off in tests): a stop that came before its end cancelled it.
LONG_SEARCH = "api/fit?model=llama-3.1-8b&gpu=rtx-4090&gpus=8"
#: How long a server may take to warm, or its processes to end, on a busy shared machine.
GENEROUS_S = 300


def wait_until_warm(url: str) -> None:
    """Wait until the server's planner is warm (its worker processes started)."""
    import json
    import time
    import urllib.request

    deadline = time.monotonic() + GENEROUS_S
    while time.monotonic() < deadline:
        with urllib.request.urlopen(url + "api/status") as answer:
            if json.load(answer)["warm"]:
                return
        time.sleep(0.2)
    raise AssertionError(f"{url} was not warm after {GENEROUS_S} s")


def start_search(url: str):
    """Start :data:`LONG_SEARCH` and read its stream until its first plan is being made (its worker
    processes are running); the open stream and the events so far."""
    import json
    import urllib.request

    stream = urllib.request.urlopen(url + LONG_SEARCH, timeout=GENEROUS_S)
    events = []
    for line in stream:
        events.append(json.loads(line))
        if events[-1]["event"] in ("progress", "error", "result"):
            break
    assert events[-1]["event"] == "progress", events
    return stream, events


def wait_until_gone(processes, bound_s: float = GENEROUS_S) -> list:
    """Wait (at most ``bound_s``) until none of ``processes`` (psutil) runs; those still running."""
    import time

    import psutil

    deadline = time.monotonic() + bound_s
    running = list(processes)
    while running and time.monotonic() < deadline:
        time.sleep(0.2)
        running = [p for p in running if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    return running
