"""The page in a real browser (Debian's chromium, driven by Playwright): change a knob, read the
numbers, compare with `memfit plan --json`. Skipped where playwright or chromium is missing."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from memfit.cli import app

runner = CliRunner()
#: A plan of a small model takes seconds; on a busy shared machine, minutes.
WAIT_MS = 600_000


def cli_plan(*args: str) -> dict:
    result = runner.invoke(app, ["plan", *args, "--json"])
    assert result.exit_code in (0, 3), result.output
    return json.loads(result.stdout)


def shown_bytes(page) -> int | None:
    value = page.get_attribute("#device-total", "data-bytes")
    return int(value) if value else None


def wait_for_total(page, expected: int) -> None:
    """Wait until the page shows ``expected`` bytes (or an error): the plan of the knobs just set."""
    page.wait_for_function(
        "expected => document.querySelector('#device-total').dataset.bytes === String(expected) "
        "|| !document.querySelector('#error').hidden",
        arg=expected,
        timeout=WAIT_MS,
    )
    assert page.is_hidden("#error"), page.inner_text("#error")
    assert shown_bytes(page) == expected


def open_page(page, url: str) -> None:
    """Go to ``url`` and wait until the page's inputs answer (its form is drawn from /api/form first)."""
    page.goto(url)
    page.wait_for_selector("body[data-ready]", timeout=WAIT_MS)


def wait_for_upload(page) -> None:
    page.wait_for_selector("#upload-chip:not([hidden]), #error:not([hidden])", timeout=WAIT_MS)
    assert page.is_hidden("#error"), page.inner_text("#error")


def categories_shown(page) -> dict[str, int]:
    rows = page.query_selector_all("#categories tbody tr")
    return {row.get_attribute("data-category"): int(row.get_attribute("data-bytes")) for row in rows}


def test_the_page_shows_memfit_plan(server, browser_page):
    page = browser_page
    expected = cli_plan("smollm2-135m", "--gpu", "rtx-4090")
    page.goto(server.url + "?gpu=rtx-4090")
    wait_for_total(page, expected["peak"]["device_total_bytes"])
    assert categories_shown(page) == expected["categories"]
    assert page.get_attribute("#verdict", "data-fits") == "true"
    assert "fits rtx-4090" in page.inner_text("#verdict")

    # Change two knobs as a user does; the page plans them, and the numbers are the command line's.
    page.select_option("#knob-method", "qlora")
    page.fill("#knob-seq_len", "512")
    expected = cli_plan("smollm2-135m", "--gpu", "rtx-4090", "--method", "qlora", "--seq-len", "512")
    wait_for_total(page, expected["peak"]["device_total_bytes"])
    assert categories_shown(page) == expected["categories"]
    assert "method=qlora" in page.url and "seq_len=512" in page.url
    assert not page.errors


def test_a_preference_plan_shows_what_memfit_plan_prints(server, browser_page):
    page = browser_page
    expected = cli_plan("smollm2-135m", "--objective", "dpo", "--seq-len", "512")
    page.goto(server.url + "?objective=dpo&seq_len=512")
    wait_for_total(page, expected["peak"]["device_total_bytes"])
    assert page.inner_text("#plan-headline").endswith("dpo (batch counts pairs)")
    assert f"reference: {expected['details']['reference']}" in page.inner_text("#plan-notes")
    assert not page.errors


def test_a_bad_knob_shows_the_cli_error_and_the_page_goes_on(server, browser_page):
    page = browser_page
    page.goto(server.url + "?gpu=rtx-4090&seq_len=512")
    page.wait_for_function("document.querySelector('#device-total').dataset.bytes", timeout=WAIT_MS)
    page.fill("#knob-rank", "0")
    page.wait_for_selector("#error:not([hidden])", timeout=WAIT_MS)
    cli = runner.invoke(app, ["plan", "--gpu", "rtx-4090", "--seq-len", "512", "--rank", "0"])
    assert cli.exit_code == 2
    assert page.inner_text("#error") == "error: " + cli.stderr.split("error: ", 1)[1].strip()
    page.fill("#knob-rank", "8")
    expected = cli_plan("--gpu", "rtx-4090", "--seq-len", "512", "--rank", "8")
    # The error of rank 0 stays on the page until the plan of rank 8 has answered.
    page.wait_for_selector("#error", state="hidden", timeout=WAIT_MS)
    wait_for_total(page, expected["peak"]["device_total_bytes"])


def test_a_dropped_config_a_link_the_longest_context_and_the_search(server, browser_page, tiny_config, tmp_path):
    page = browser_page
    open_page(page, server.url + "?budget=1GiB")
    page.set_input_files("#files", str(tiny_config))  # what dropping the file on the page sends
    wait_for_upload(page)
    page.fill("#knob-seq_len", "256")
    expected = cli_plan(str(tiny_config), "--budget", "1GiB", "--seq-len", "256")
    wait_for_total(page, expected["peak"]["device_total_bytes"])

    # The link reproduces the view: the same model, knobs and numbers in a fresh page.
    link = page.url
    fresh = page.context.new_page()
    fresh.goto(link)
    wait_for_total(fresh, expected["peak"]["device_total_bytes"])
    fresh.close()

    # Memory against sequence length: one plan a length, the longest that fits the budget.
    page.click("[data-view=context]")
    page.wait_for_function("document.querySelector('#longest').dataset.tokens !== undefined", timeout=WAIT_MS)
    assert page.get_attribute("#longest", "data-tokens") == "1024"  # the model's max_position_embeddings fits
    assert cli_plan(str(tiny_config), "--budget", "1GiB", "--seq-len", "1024")["fits"]
    assert "the model's longest sequence" in page.inner_text("#context-status")

    # The search: rows stream in, and the final table is memfit fit's.
    page.click("[data-view=fit]")
    page.fill("#fit-batch", "2")
    page.click("#fit-start")
    page.wait_for_function("document.querySelector('#fit-summary').dataset.count !== undefined", timeout=WAIT_MS)
    fit = runner.invoke(
        app, ["fit", str(tiny_config), "--budget", "1GiB", "--batch-size", "2", "--seq-len", "256", "--json"]
    )
    expected_fits = json.loads(fit.stdout)["fits"]
    rows = page.query_selector_all("#fits tbody tr")
    assert len(rows) == len(expected_fits) > 0
    assert [int(r.query_selector("td[data-bytes]").get_attribute("data-bytes")) for r in rows] == [
        f["peak"]["device_total_bytes"] for f in expected_fits
    ]

    # Copy as CLI gives the command whose --json the page shows.
    page.click("[data-view=plan]")
    page.click("#copy-cli")
    page.wait_for_selector("#export[open]")
    assert page.input_value("#export-text") == "memfit plan config.json --budget 1GiB --seq-len 256"
    page.keyboard.press("Escape")
    assert not page.errors


def test_a_dropped_run_is_shown_against_its_plan(server, browser_page, tmp_path):
    page = browser_page
    plan = cli_plan("smollm2-135m", "--seq-len", "512")
    reading = {"cuda:0": {"peak_allocated_bytes": 2**30, "peak_reserved_bytes": 2**30 + 2**26, "process_bytes": 2**31}}
    records = [
        {"kind": "start", "schema": 1, "expected_devices": ["cuda:0"], "plan": plan},
        {"kind": "step", "step": 1, "rss_bytes": 2**29, "devices": reading},
        {
            "kind": "attribution",
            "first_step": 1,
            "categories": {"weights": plan["categories"]["weights"], "activations": 12345},
        },
    ]
    memory = tmp_path / "memory.jsonl"
    memory.write_text("".join(json.dumps(r) + "\n" for r in records))
    open_page(page, server.url)
    page.set_input_files("#files", str(memory))
    page.wait_for_selector("#run-table:not([hidden])", timeout=WAIT_MS)
    cells = {
        row.query_selector("td").inner_text().strip(): row.query_selector_all("td")[2].inner_text()
        for row in page.query_selector_all("#run-table tbody tr")
    }
    assert cells["activations"] == "12.1 KiB" and cells["gradients"] == "not measured"
    assert "run=" not in page.url and "view=run" in page.url


def test_a_dropped_training_config_fills_the_form_and_is_planned_as_memfit_plan(server, browser_page, tmp_path):
    page = browser_page
    config = tmp_path / "axolotl.yml"
    config.write_text(
        "base_model: smollm2-135m\nadapter: lora\nlora_r: 8\nlora_alpha: 16\nlora_target_linear: true\n"
        "sequence_len: 256\nmicro_batch_size: 1\ngradient_accumulation_steps: 4\nbf16: true\n"
        "deepspeed: ds_z2.json\n"
    )
    (tmp_path / "ds_z2.json").write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    open_page(page, server.url + "?gpu=rtx-4090")
    page.set_input_files("#files", [str(config), str(tmp_path / "ds_z2.json")])  # both files, as a drop sends them
    wait_for_upload(page)
    assert "Axolotl: smollm2-135m" in page.inner_text("#upload-name")
    assert page.input_value("#knob-seq_len") == "256" and page.input_value("#knob-rank") == "8"  # the config's knobs
    expected = cli_plan(str(config), "--gpu", "rtx-4090")
    wait_for_total(page, expected["peak"]["device_total_bytes"])
    assert "seq_len" not in page.url  # only what is changed is sent, as options override a config's keys

    page.fill("#knob-rank", "32")
    expected = cli_plan(str(config), "--gpu", "rtx-4090", "--rank", "32")
    wait_for_total(page, expected["peak"]["device_total_bytes"])
    page.click("#copy-cli")
    page.wait_for_selector("#export[open]")
    assert page.input_value("#export-text") == "memfit plan axolotl.yml --gpu rtx-4090 --rank 32"
    page.keyboard.press("Escape")
    assert not page.errors
