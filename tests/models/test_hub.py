"""Models by their Hub id, against a local Hub (tests/models/local_hub.py): every way it works and fails."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import types
from pathlib import Path

import pytest

pytest.importorskip("huggingface_hub")

from hub_repos import (
    ADAPTER,
    CATALOG_SOURCE,
    GATED,
    GRANTED_TOKEN,
    LONG_CONTEXT,
    MODEL,
    PICKLED,
    REMOTE_CODE,
    hf_home_is_a_file,
    set_offline,
)

from memfit.models.catalog import ModelNotFoundError, load_catalog_config, resolve_model
from memfit.models.hub import HubError, fetch_adapter, fetch_config, fetch_model, is_hub_id, looks_like_hub_id

SHARD = "model-00001-of-00002.safetensors"


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def no_sleep_between_retries(monkeypatch) -> None:
    """huggingface_hub waits 1 s before each resume attempt; the tests need not."""
    from huggingface_hub import file_download

    if hasattr(file_download, "time"):
        monkeypatch.setattr(file_download, "time", types.SimpleNamespace(sleep=lambda seconds: None))


def blobs(hub) -> list[Path]:
    folder = hub.cache / "models--memfit-test--tiny-llama" / "blobs"
    return sorted(folder.iterdir()) if folder.is_dir() else []


# -- names ---------------------------------------------------------------------------------------


def test_what_counts_as_a_hub_id(tmp_path, monkeypatch):
    for text in ("Qwen/Qwen2.5-7B", "meta-llama/Llama-3.1-8B", "a/b", "org_1/name.v2"):
        assert looks_like_hub_id(text), text
    for text in (
        "llama-3.1-8b",
        "./models/x",
        "/abs/path",
        "org/name/extra",
        "org/config.json",
        "org/-bad",
        "org/a--b",
        "~/x",
        "org/",
        "a\\b",
    ):
        assert not looks_like_hub_id(text), text
    monkeypatch.chdir(tmp_path)
    assert is_hub_id("models/llama")
    (tmp_path / "models" / "llama").mkdir(parents=True)
    assert not is_hub_id("models/llama")  # a local path of the same spelling wins


def test_importing_the_catalog_and_hub_modules_imports_no_huggingface_hub():
    code = (
        "import sys; from memfit.models.catalog import resolve_model; import memfit.models.hub; "
        "resolve_model('smollm2-135m'); print('huggingface_hub' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


# -- config.json only (plan, fit) ----------------------------------------------------------------


def test_public_repo_config_alone_is_fetched(hub, built):
    source = resolve_model(MODEL)
    assert source.origin == "hub" and source.name == MODEL
    assert source.config == built.main_config
    assert source.hub == {"repo_id": MODEL, "revision": "main", "commit": hub.main}
    assert hub.server.weight_requests() == []
    fetched = [r.path for r in hub.server.requests if "/resolve/" in r.path and r.method == "GET"]
    assert fetched == [f"/{MODEL}/resolve/{hub.main}/config.json"]
    # Cached now: the same plan again asks the Hub for the listing only.
    before = len(hub.server.requests)
    assert resolve_model(MODEL).config == built.main_config
    assert [r.path.split("?")[0] for r in hub.server.requests[before:]] == [f"/api/models/{MODEL}/revision/main"]


def test_revision_pins_a_branch_or_a_commit(hub, built):
    assert resolve_model(MODEL, revision="long-context").config["max_position_embeddings"] == LONG_CONTEXT
    assert resolve_model(MODEL, revision=hub.branch).config["max_position_embeddings"] == LONG_CONTEXT
    pinned = resolve_model(MODEL, revision=hub.main)
    assert pinned.config["max_position_embeddings"] == 128 and pinned.name == f"{MODEL}@{hub.main}"
    assert resolve_model(MODEL, revision="long-context").hub["commit"] == hub.branch


def test_a_revision_that_does_not_exist(hub):
    with pytest.raises(HubError) as info:
        fetch_config(MODEL, "v9")
    assert info.value.kind == "revision"
    assert "revision 'v9' does not exist in memfit-test/tiny-llama" in str(info.value)
    assert "/commits/main" in str(info.value)


def test_a_revision_needs_a_hub_id():
    with pytest.raises(ModelNotFoundError, match="applies only to a Hugging Face Hub id"):
        resolve_model("smollm2-135m", revision="main")


def test_a_repo_that_does_not_exist_names_close_catalog_entries(hub):
    with pytest.raises(HubError) as info:
        resolve_model("Qwen/Qwen2.5-7C")
    message = str(info.value)
    assert info.value.kind == "missing-repo"
    assert "'Qwen/Qwen2.5-7C' is not a local path and not a model on http://127.0.0.1" in message
    assert "Did you mean the Hub's 'Qwen/Qwen2.5-7B' or the catalog's 'qwen2.5-7b'" in message and "HF_TOKEN" in message


def test_gated_repo_without_a_token(hub):
    with pytest.raises(HubError) as info:
        fetch_model(GATED)
    message = str(info.value)
    assert info.value.kind == "gated"
    assert f"{hub.server.endpoint}/{GATED}" in message and "HF_TOKEN" in message and "hf auth login" in message
    statuses = [r for r in hub.server.requests if "/resolve/" in r.path]
    assert statuses and all("authorization" not in r.headers for r in statuses)
    assert hub.server.weight_requests() == []


def test_gated_repo_with_a_token_that_has_no_access(hub, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_someone_else")
    with pytest.raises(HubError) as info:
        fetch_config(GATED)
    assert info.value.kind == "gated"
    assert "the token in use" in str(info.value) and "request access at" in str(info.value)


def test_gated_repo_with_access_and_the_token_stays_on_the_hub(hub, monkeypatch, built):
    monkeypatch.setenv("HF_TOKEN", GRANTED_TOKEN)
    snapshot = fetch_model(GATED, progress=False)
    assert sha256(snapshot.folder / SHARD) == sha256(built.model / SHARD)
    hub_calls = [r for r in hub.server.requests if r.server == "hub" and "/resolve/" in r.path]
    cdn_calls = [r for r in hub.server.requests if r.server == "cdn"]
    assert hub_calls and all(r.headers.get("authorization") == f"Bearer {GRANTED_TOKEN}" for r in hub_calls)
    assert cdn_calls and all("authorization" not in r.headers for r in cdn_calls)


def test_a_file_the_listing_has_but_the_hub_no_longer_serves(hub):
    hub.server.hidden.add("model-00002-of-00002.safetensors")
    with pytest.raises(HubError) as info:
        fetch_model(MODEL, progress=False)
    assert info.value.kind == "file" and "has no file model-00002-of-00002.safetensors" in str(info.value)


def test_an_adapter_is_not_a_model_and_a_model_is_not_an_adapter(hub):
    with pytest.raises(HubError, match="It is a PEFT adapter") as info:
        fetch_model(ADAPTER)
    assert info.value.kind == "file"
    with pytest.raises(HubError, match="It is a model"):
        fetch_adapter(MODEL)


def test_remote_code_is_refused_with_what_it_means(hub):
    with pytest.raises(HubError) as info:
        resolve_model(REMOTE_CODE)
    message = str(info.value)
    assert info.value.kind == "remote-code"
    assert "trust_remote_code" in message and "running that code on this machine" in message
    assert "configuration_custom.py" in message


def test_a_catalog_entrys_source_falls_back_to_the_shipped_config_when_the_hub_cannot_answer(hub):
    source = resolve_model(CATALOG_SOURCE)  # served gated, and no token is set
    assert source.origin == "catalog" and source.name == CATALOG_SOURCE
    assert source.config == load_catalog_config("smollm2-135m")
    assert "gated" in source.note and "shipped copy" in source.note
    with pytest.raises(HubError):  # a pinned revision means that commit's config: no stand-in
        resolve_model(CATALOG_SOURCE, revision="main")
    hub.server.down()
    assert "cannot reach" in resolve_model(CATALOG_SOURCE).note


@pytest.mark.parametrize(
    "repo_id, name, positions",
    [
        ("Qwen/Qwen2.5-1.5B", "qwen2.5-1.5b", 131072),
        ("meta-llama/Llama-3.1-8B-Instruct", "llama-3.1-8b", 131072),
        ("Qwen/Qwen2-0.5B-Instruct", "qwen2.5-0.5b", 32768),
    ],
)
def test_a_variant_of_a_catalog_entry_falls_back_to_its_config_and_says_which(
    hub, monkeypatch, repo_id, name, positions
):
    set_offline(monkeypatch)  # and nothing in the cache
    source = resolve_model(repo_id)
    assert source.origin == "catalog" and source.name == repo_id
    assert source.config == dict(load_catalog_config(name), max_position_embeddings=positions)
    assert source.note.startswith("HF_HUB_OFFLINE=1 is set: planned with memfit's shipped copy of ")
    assert f"(catalog name {name}), which needs no network: {repo_id} has its shape" in source.note
    with pytest.raises(HubError):  # a pinned revision means that commit's config: no stand-in
        resolve_model(repo_id, revision="main")


def test_hf_home_that_is_a_file_is_named_before_the_hub_is_asked(hub, tmp_path, monkeypatch):
    home = hf_home_is_a_file(monkeypatch, tmp_path / "notes.txt")
    with pytest.raises(HubError) as info:
        resolve_model(MODEL)
    assert info.value.kind == "cache"
    assert str(info.value) == (
        f"HF_HOME ({str(home)!r}) is a file, not a folder: huggingface_hub keeps its cache and your "
        "token in that folder. Set HF_HOME to a folder, or unset it."
    )
    assert hub.server.requests == []  # not the server's fault, and the server was never asked
    assert home.read_text() == "not a folder\n"


def test_hf_home_under_a_file_names_the_file(hub, tmp_path, monkeypatch):
    home = hf_home_is_a_file(monkeypatch, tmp_path / "notes.txt")
    monkeypatch.setenv("HF_HUB_CACHE", str(home / "hub"))
    with pytest.raises(HubError, match=rf"HF_HUB_CACHE \('{home}/hub'\) is under '{home}', a file, not a folder"):
        fetch_config(MODEL)
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.delenv("HF_HOME")
    with pytest.raises(
        HubError, match=rf"the Hugging Face cache folder '{home}/hub' cannot be made: '{home}' is a file"
    ):
        fetch_model(MODEL)  # the default place: no variable to name, the path and what to do


def test_a_catalog_model_is_planned_from_its_shipped_config_when_hf_home_is_a_file(hub, tmp_path, monkeypatch):
    home = hf_home_is_a_file(monkeypatch, tmp_path / "notes.txt")
    for repo_id, name in (("meta-llama/Llama-3.1-8B", "llama-3.1-8b"), (CATALOG_SOURCE, "smollm2-135m")):
        source = resolve_model(repo_id)
        assert source.origin == "catalog" and source.config == load_catalog_config(name)
        assert source.note.startswith(
            f"HF_HOME ({str(home)!r}) is a file, not a folder: planned with memfit's shipped copy"
        )
    assert hub.server.requests == []


# -- weights (train, merge) ----------------------------------------------------------------------


def test_model_files_are_fetched_from_one_commit_and_match(hub, built, capsys):
    snapshot = fetch_model(MODEL, console=None)
    names = sorted(p.name for p in snapshot.folder.iterdir())
    assert names == sorted(p.name for p in built.model.iterdir())
    for name in names:
        assert sha256(snapshot.folder / name) == sha256(built.model / name), name
    assert snapshot.commit == hub.main and snapshot.downloaded_bytes > 0
    resolved = {r.path.split("/resolve/")[1].split("/")[0] for r in hub.server.requests if "/resolve/" in r.path}
    assert resolved == {hub.main}
    err = capsys.readouterr().err  # not a terminal: plain lines
    assert f"downloading {MODEL}" in err and SHARD in err and "downloaded" in err


def test_on_a_terminal_downloads_show_a_live_bar(hub):
    import io

    from rich.console import Console

    buffer = io.StringIO()
    fetch_model(MODEL, console=Console(file=buffer, force_terminal=True, width=100))
    text = buffer.getvalue()
    assert "\x1b[" in text and "━" in text  # the live bar drew on the terminal (and was cleared)
    assert f"downloaded {MODEL}" in text and f"  {SHARD}" not in text  # no per-file lines on a terminal


def test_weights_only_opt_in_refuses_then_converts_a_pickle_only_repo(hub, built):
    with pytest.raises(HubError) as info:
        fetch_model(PICKLED, opt_in="allow_pickle_weights: true")
    message = str(info.value)
    assert info.value.kind == "pickle" and "pytorch_model.bin" in message and "allow_pickle_weights: true" in message
    assert "run code" in message
    assert hub.server.weight_requests() == []  # refused before any weights were downloaded

    snapshot = fetch_model(PICKLED, allow_pickle=True, progress=False)
    assert hub.cache not in snapshot.folder.parents  # converted in memfit's cache, never in huggingface_hub's
    assert (snapshot.folder / "model.safetensors").is_file() and not list(snapshot.folder.glob("*.bin"))
    import torch
    from safetensors.torch import load_file

    converted = load_file(snapshot.folder / "model.safetensors")
    original = torch.load(built.pickled / "pytorch_model.bin", weights_only=True)
    assert set(converted) <= set(original) and "model.embed_tokens.weight" in converted
    for name, tensor in converted.items():
        assert torch.equal(tensor, original[name]), name
    before = len(hub.server.weight_requests())
    assert fetch_model(PICKLED, allow_pickle=True, progress=False).folder == snapshot.folder  # converted once
    assert len(hub.server.weight_requests()) == before


def test_a_dropped_connection_resumes_where_it_stopped(hub, built, monkeypatch):
    from huggingface_hub import constants

    no_sleep_between_retries(monkeypatch)
    # huggingface_hub writes what it received in chunks (10 MB by default) and resumes after the last
    # one written; small chunks let a cut halfway through a tiny shard fall after some.
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 4096)
    hub.server.drop[SHARD] = 1
    snapshot = fetch_model(MODEL, progress=False)
    assert sha256(snapshot.folder / SHARD) == sha256(built.model / SHARD)
    ranges = [r.headers.get("range") for r in hub.server.requests if r.server == "cdn" and r.headers.get("range")]
    assert ranges and all(int(value.split("=")[1].split("-")[0]) > 0 for value in ranges)  # resumed, not restarted
    assert not [p for p in blobs(hub) if p.name.endswith(".incomplete")]


def test_an_interrupted_download_leaves_nothing_a_later_run_trusts(hub, built, monkeypatch):
    no_sleep_between_retries(monkeypatch)
    # Every attempt is cut halfway; with the default 10 MB chunks nothing of the small shard is
    # written per attempt, so huggingface_hub gives up after its retries, as on a dead connection.
    hub.server.drop[SHARD] = 1000
    with pytest.raises(HubError) as info:
        fetch_model(MODEL, progress=False)
    assert info.value.kind == "interrupted" and "Run the same command again" in str(info.value)
    digest = hashlib.sha256((built.model / SHARD).read_bytes()).hexdigest()
    snapshot_folder = hub.cache / "models--memfit-test--tiny-llama" / "snapshots" / hub.main
    assert not (snapshot_folder / SHARD).exists()
    assert not [p for p in blobs(hub) if p.name.startswith(digest)]  # neither the blob nor a partial file

    hub.server.drop.clear()
    snapshot = fetch_model(MODEL, progress=False)
    assert sha256(snapshot.folder / SHARD) == digest


def test_a_corrupt_download_is_deleted_before_anything_uses_it(hub, built):
    hub.server.corrupt[SHARD] = 1
    with pytest.raises(HubError) as info:
        fetch_model(MODEL, progress=False)
    assert info.value.kind == "corrupt" and "does not match the SHA-256" in str(info.value)
    snapshot_folder = hub.cache / "models--memfit-test--tiny-llama" / "snapshots" / hub.main
    assert not (snapshot_folder / SHARD).exists()
    snapshot = fetch_model(MODEL, progress=False)  # the next run downloads it anew
    assert sha256(snapshot.folder / SHARD) == sha256(built.model / SHARD)


# -- no network ----------------------------------------------------------------------------------


def test_offline_with_a_cache(hub, monkeypatch, built):
    fetch_model(MODEL, progress=False)
    fetch_config(MODEL, "long-context")
    set_offline(monkeypatch)
    before = len(hub.server.requests)
    snapshot = fetch_model(MODEL)
    assert snapshot.commit == hub.main and "HF_HUB_OFFLINE=1" in snapshot.note
    assert resolve_model(MODEL, revision="long-context").config["max_position_embeddings"] == LONG_CONTEXT
    assert len(hub.server.requests) == before  # not one request
    set_offline(monkeypatch, False)
    hub.server.down()
    source = resolve_model(MODEL)
    assert source.config == built.main_config and "cannot reach" in source.note


def test_offline_without_a_cache(hub, monkeypatch):
    set_offline(monkeypatch)
    with pytest.raises(HubError) as info:
        resolve_model(MODEL)
    message = str(info.value)
    assert info.value.kind == "offline"
    assert "HF_HUB_OFFLINE=1 is set" in message and "not in the cache" in message
    assert f"hf download {MODEL} --include 'config.json'" in message and "Unset HF_HUB_OFFLINE" in message


def test_no_network_and_no_cache(hub):
    hub.server.down()
    with pytest.raises(HubError) as info:
        fetch_model(MODEL)
    message = str(info.value)
    assert info.value.kind == "network"
    assert f"cannot reach {hub.server.endpoint}" in message and "not in the cache" in message
    assert "hf download" in message and "HF_HUB_OFFLINE=1" in message


def test_offline_with_only_the_config_cached_says_what_is_missing(hub, monkeypatch):
    fetch_config(MODEL)
    set_offline(monkeypatch)
    with pytest.raises(HubError, match="not fully in the cache"):
        fetch_model(MODEL)
