// memfit ui: the form is built from /api/form (RunSpec's knobs), every answer comes from the JSON API.
"use strict";

const COLORS = {
  weights: "#4e79a7", trainable: "#59a14f", gradients: "#f28e2b", optimizer: "#e15759",
  activations: "#76b7b2", temporaries: "#edc948", allocator: "#b07aa1", runtime: "#9c755f",
};
const GiB = 2 ** 30;
const $ = (id) => document.getElementById(id);
const state = { form: null, upload: null, view: "plan", plan: null, charts: {}, requests: {}, run: null };

// ---- small helpers ------------------------------------------------------------------------------

function formatBytes(n) {  // as memfit.units.format_bytes: 512 B, 1.2 MiB, 23.5 GiB
  if (n === null || n === undefined) return "—";
  const sign = n < 0 ? "-" : "";
  let v = Math.abs(n);
  if (v < 1024) return `${sign}${v} B`;
  const units = ["KiB", "MiB", "GiB", "TiB", "PiB"];
  for (let i = 0; i < units.length; i++) {
    v /= 1024;
    if (Math.round(v * 10) / 10 < 1024 || i === units.length - 1) return `${sign}${v.toFixed(1)} ${units[i]}`;
  }
}
const count = (n) => n >= 1e9 ? `${(n / 1e9).toFixed(3)} B` : n >= 1e6 ? `${(n / 1e6).toFixed(2)} M` : n.toLocaleString("en-US");
function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v; else if (k === "text") node.textContent = v; else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c);
  return node;
}
function showError(message) {
  $("error").hidden = !message;
  $("error").textContent = message ? `error: ${message}` : "";
}
async function answer(response) {
  let data;
  try {
    data = await response.json();
  } catch (err) {
    // A request replaced while its body was read is aborted, not answered: no error to show.
    if (err.name === "AbortError") throw err;
    throw new Error(response.ok ? `an answer that is not JSON (${response.status})` : `${response.status} ${response.statusText}`);
  }
  if (!response.ok) throw new Error(data.error || response.statusText);
  return data;
}
// A request of a kind replaces the one before it (a knob changed meanwhile).
function request(kind) {
  if (state.requests[kind]) state.requests[kind].abort();
  state.requests[kind] = new AbortController();
  return state.requests[kind].signal;
}
async function ndjson(url, onEvent, signal) {
  const response = await fetch(url, { signal });
  if (!response.ok) await answer(response);
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n")) >= 0) {
      const line = buffer.slice(0, end).trim();
      buffer = buffer.slice(end + 1);
      if (line) onEvent(JSON.parse(line));
    }
  }
}

// ---- the form, from RunSpec's declarations ------------------------------------------------------

function knobInput(knob) {
  const id = `knob-${knob.name}`;
  let input;
  if (knob.kind === "choice") {
    input = el("select", { id, name: knob.name });
    for (const c of knob.choices) input.append(el("option", { value: c, text: c }));
  } else if (knob.kind === "bool") {
    input = el("input", { id, name: knob.name, type: "checkbox" });
  } else {
    input = el("input", { id, name: knob.name, spellcheck: "false", inputmode: knob.kind === "other" ? "text" : "decimal" });
    if (knob.default === null) input.placeholder = knob.name === "alpha" ? "2 × rank" : "none";
  }
  const label = el("label", { class: "field", title: `${knob.flag}: ${knob.help}` }, el("span", { text: knob.name.replaceAll("_", " ") }), input);
  setKnob(knob, null, input);
  input.addEventListener(knob.kind === "choice" || knob.kind === "bool" ? "change" : "input", changed);
  return label;
}
// A dropped training config's knobs stand where the defaults do: only what you change is sent, as
// `memfit plan CONFIG --opt value` overrides the config's own value.
function knobDefault(knob) {
  const own = state.upload && state.upload.knobs ? state.upload.knobs[knob.name] : undefined;
  if (own !== undefined) return own;
  return knob.default === null ? "" : String(knob.default);
}
function resetKnobs() { for (const knob of state.form.knobs) setKnob(knob, null); }
function setKnob(knob, value, input = $(`knob-${knob.name}`)) {
  const text = value === null || value === undefined ? knobDefault(knob) : String(value);
  if (knob.kind === "bool") input.checked = ["true", "1", "yes", "on"].includes(text.toLowerCase());
  else input.value = text;
}
function knobValue(knob) {  // the text the option gets, or null when it is the default
  const input = $(`knob-${knob.name}`);
  const text = knob.kind === "bool" ? String(input.checked) : input.value.trim();
  input.closest(".field").classList.toggle("changed", text !== knobDefault(knob) && text !== "");
  return text === knobDefault(knob) || text === "" ? null : text;
}
function modelName() { return state.upload ? state.upload.model : ($("model").value.trim() || state.form.default_model); }

function planParams() {
  const p = new URLSearchParams({ model: modelName() });
  if ($("gpu").value) p.set("gpu", $("gpu").value);
  if ($("budget").value.trim()) p.set("budget", $("budget").value.trim());
  for (const knob of state.form.knobs) {
    const value = knobValue(knob);
    if (value !== null) p.set(knob.name, value);
  }
  return p;
}
function fitParams() {  // memfit fit's options: the search chooses method, checkpointing, optimizer and the split
  const plan = planParams();
  const p = new URLSearchParams({ model: plan.get("model") });
  for (const key of ["gpu", "budget"]) if (plan.has(key)) p.set(key, plan.get(key));
  if ($("fit-batch").value.trim()) p.set("batch_size", $("fit-batch").value.trim());
  for (const key of ["seq_len", "precision", "gpus", "shard", ...state.form.fit_knobs]) if (plan.has(key)) p.set(key, plan.get(key));
  return p;
}

async function readUrl() {
  const url = new URLSearchParams(location.search);
  const model = url.get("model");
  if (model && model.startsWith("upload-")) {
    state.upload = { model, filename: url.get("model_file") || "config.json" };
    try {  // a dropped training config's knobs; gone when the server that read it stopped (the plan says so)
      state.upload = await answer(await fetch(`/api/model?model=${encodeURIComponent(model)}`));
    } catch (err) { showError(err.message); }
  }
  $("model").value = model && !state.upload ? model : state.form.default_model;
  $("gpu").value = url.get("gpu") || "";
  $("budget").value = url.get("budget") || "";
  $("fit-batch").value = url.get("fit_batch") || "";
  for (const knob of state.form.knobs) setKnob(knob, url.get(knob.name));
  if (state.form.knobs.some((k) => !k.main && url.has(k.name))) $("more").open = true;
  return url.get("view") || "plan";
}
function writeUrl() {
  const p = planParams();
  if (state.upload) p.set("model_file", state.upload.filename);
  if ($("fit-batch").value.trim()) p.set("fit_batch", $("fit-batch").value.trim());
  if (state.view !== "plan") p.set("view", state.view);
  history.replaceState(null, "", `?${p}`);
}

let timer = null;
function changed() {
  writeUrl();
  clearTimeout(timer);
  timer = setTimeout(refresh, 350);
}
function refresh() {
  refreshPlan();
  if (state.view === "context") refreshContext();
  $("fit-what").textContent = fitDescription();
}

// ---- the plan -----------------------------------------------------------------------------------

function cardLinePlugin(axis) {
  return {
    id: "cardLine",
    afterDatasetsDraw(chart, args, opts) {
      if (!opts || opts.value === null || opts.value === undefined) return;
      const { ctx, chartArea: area, scales } = chart;
      const at = scales[axis].getPixelForValue(opts.value);
      ctx.save();
      ctx.strokeStyle = "#c2372f"; ctx.fillStyle = "#c2372f"; ctx.lineWidth = 1.5; ctx.setLineDash([6, 4]);
      ctx.font = "12px system-ui, sans-serif";
      ctx.beginPath();
      if (axis === "x") {
        ctx.moveTo(at, area.top - 6); ctx.lineTo(at, area.bottom);
        ctx.stroke();
        ctx.textAlign = at > area.right - 160 ? "right" : "left";
        ctx.fillText(opts.label, at + (ctx.textAlign === "left" ? 5 : -5), area.top + 4);
      } else {
        ctx.moveTo(area.left, at); ctx.lineTo(area.right, at);
        ctx.stroke();
        ctx.textAlign = "left";
        ctx.fillText(opts.label, area.left + 6, at - 6);
      }
      ctx.restore();
    },
  };
}
function chart(id, config) {
  if (state.charts[id]) state.charts[id].destroy();
  state.charts[id] = new Chart($(id), config);
  return state.charts[id];
}
const gib = (bytes) => bytes / GiB;
const gibTicks = { callback: (v) => formatBytes(Math.round(v * GiB)) };

async function refreshPlan() {
  const signal = request("plan");
  $("busy-plan").hidden = false;
  try {
    const plan = await answer(await fetch(`/api/plan?${planParams()}`, { signal }));
    const explained = await answer(await fetch("/api/explain", { method: "POST", body: JSON.stringify(plan), signal }));
    state.plan = plan;
    showError(null);
    renderPlan(plan, explained);
  } catch (err) {
    if (err.name !== "AbortError") { showError(err.message); document.body.classList.add("stale"); }
  } finally {
    if (!signal.aborted) $("busy-plan").hidden = true;
  }
}

function renderPlan(plan, explained) {
  const total = plan.peak.device_total_bytes;
  const card = plan.gpu ? plan.gpu.memory_bytes : null;
  $("device-total").textContent = formatBytes(total);
  $("device-total").dataset.bytes = total;
  const verdict = $("verdict");
  verdict.className = "verdict" + (plan.fits === true ? " fits" : plan.fits === false ? " over" : "");
  verdict.dataset.fits = String(plan.fits);
  verdict.textContent = plan.gpu === null ? "no card chosen: pick a GPU or a budget to check against"
    : plan.fits ? `fits ${plan.gpu.name} (${formatBytes(card)}) with ${formatBytes(plan.headroom_bytes)} headroom`
    : `does not fit ${plan.gpu.name} (${formatBytes(card)}): ${formatBytes(-plan.headroom_bytes)} over`;

  const names = Object.keys(plan.categories);
  chart("plan-chart", {
    type: "bar",
    data: { labels: ["at peak"], datasets: names.map((n) => ({ label: n, data: [gib(plan.categories[n])], backgroundColor: COLORS[n], barThickness: 34 })) },
    options: {
      indexAxis: "y", maintainAspectRatio: false, animation: false,
      layout: { padding: { top: 18 } },
      scales: { x: { stacked: true, min: 0, suggestedMax: Math.max(gib(total), card ? gib(card) : 0) * 1.04, ticks: gibTicks }, y: { stacked: true, display: false } },
      plugins: {
        legend: { position: "bottom", labels: { boxWidth: 10, boxHeight: 10 } },
        tooltip: { callbacks: { label: (c) => `${c.dataset.label}: ${formatBytes(plan.categories[c.dataset.label])}` } },
        cardLine: card ? { value: gib(card), label: `${plan.gpu.name} · ${formatBytes(card)}` } : null,
      },
    },
    plugins: [cardLinePlugin("x")],
  });

  const body = $("categories").tBodies[0];
  body.replaceChildren(...names.map((n) => el("tr", { "data-category": n, "data-bytes": plan.categories[n] },
    el("td", {}, el("span", { class: "swatch", style: `background:${COLORS[n]}` }), n),
    el("td", { class: "num", text: formatBytes(plan.categories[n]) }),
    el("td", { class: "num", text: `${Math.round((100 * plan.categories[n]) / (total || 1))}%` }),
    el("td", { class: "help", text: explained.category_help[n] || "" }))));

  const d = plan.details || {};
  const facts = [
    ["peak allocated", formatBytes(plan.peak.allocated_bytes)],
    ["peak reserved", formatBytes(plan.peak.reserved_bytes)],
    ["device total", `${formatBytes(total)} (what nvidia-smi shows)`],
    ["peak happens in", plan.peak.phase],
  ];
  if (d.total_params) facts.push(["parameters", `${count(d.total_params)}, trainable ${count(d.trainable_params)}`]);
  if (d.host_peak_bytes) facts.push(["host memory", formatBytes(d.host_peak_bytes)]);
  if (d.paged_peak_bytes) facts.push(["paged optimizer states", formatBytes(d.paged_peak_bytes)]);
  $("peaks").replaceChildren(...facts.flatMap(([k, v]) => [el("dt", { text: k }), el("dd", { text: v })]));

  // The words are memfit plan's, made by the server (/api/explain): its first line (a preference
  // objective's batch of pairs), the precision, and the facts under its figures (attention, the
  // reference model, the memory-lean step).
  $("plan-headline").textContent = explained.headline;
  $("plan-precision").textContent = explained.precision;
  const notes = [];
  if (plan.fits === false && explained.suggestions.length) notes.push(el("p", { class: "tip", text: `Try ${explained.suggestions.join(", ")}.` }));
  for (const line of explained.lines) notes.push(el("p", { text: line }));
  for (const note of d.notes || []) notes.push(el("p", { class: "muted", text: `note: ${note}` }));
  $("plan-notes").replaceChildren(...notes);
  document.body.classList.remove("stale");
}

// ---- memory against sequence length -------------------------------------------------------------

async function refreshContext() {
  const signal = request("context");
  const points = [];
  let card = null;
  $("busy-context").hidden = false;
  $("context-status").textContent = "planning each length…";
  $("longest").textContent = "—";
  const draw = () => {
    points.sort((a, b) => a.seq_len - b.seq_len);
    const names = points.length ? Object.keys(points[0].plan.categories) : [];
    chart("context-chart", {
      type: "line",
      data: {
        labels: points.map((p) => p.seq_len.toLocaleString("en-US")),
        datasets: names.map((n) => ({ label: n, data: points.map((p) => gib(p.plan.categories[n])), backgroundColor: COLORS[n] + "cc", borderColor: COLORS[n], fill: true, pointRadius: 2, stack: "plan" })),
      },
      options: {
        maintainAspectRatio: false, animation: false,
        scales: { y: { stacked: true, min: 0, suggestedMax: card ? gib(card) * 1.08 : undefined, ticks: gibTicks }, x: { title: { display: true, text: "tokens a sequence" } } },
        plugins: {
          legend: { position: "bottom", labels: { boxWidth: 10, boxHeight: 10 } },
          tooltip: { mode: "index", intersect: false, callbacks: { footer: (items) => `device total: ${formatBytes(points[items[0].dataIndex].plan.peak.device_total_bytes)}` } },
          cardLine: card ? { value: gib(card), label: `${points[0].plan.gpu.name} · ${formatBytes(card)}` } : null,
        },
      },
      plugins: [cardLinePlugin("y")],
    });
  };
  try {
    await ndjson(`/api/context?${planParams()}`, (event) => {
      if (event.plan) {
        points.push(event);
        card = event.plan.gpu ? event.plan.gpu.memory_bytes : null;
        $("context-status").textContent = `${points.length} plans…`;
        draw();
      } else if (event.error) {
        $("context-status").textContent = event.error;
      } else if ("longest" in event) {
        const longest = event.longest;
        const box = $("longest");
        box.dataset.tokens = longest ? longest.seq_len : "";
        box.textContent = !longest ? "no card chosen"
          : longest.seq_len === 0 ? `not even ${points[0].seq_len.toLocaleString("en-US")} tokens`
          : `${longest.exact ? "" : "about "}${longest.seq_len.toLocaleString("en-US")} tokens`;
        const atLimit = longest && longest.seq_len && longest.seq_len === event.max_positions;
        $("context-status").textContent = longest && !longest.exact && longest.between
          ? `between the plans at ${longest.between.map((n) => n.toLocaleString("en-US")).join(" and ")} tokens`
          : atLimit ? `the model's longest sequence (max_position_embeddings) fits; ${points.length} plans` : `${points.length} plans`;
      }
    }, signal);
    showError(null);
  } catch (err) {
    if (err.name !== "AbortError") { showError(err.message); $("context-status").textContent = ""; }
  } finally {
    if (!signal.aborted) $("busy-context").hidden = true;
  }
}

// ---- what fits ----------------------------------------------------------------------------------

function fitDescription() {
  const p = fitParams();
  const target = p.get("gpu") ? p.get("gpu") : p.get("budget") ? `a ${p.get("budget")} budget` : "no card yet (pick a GPU or a budget)";
  const tool = state.upload && state.upload.tool_title;
  if (tool) {
    return `memfit fit ${state.upload.filename}: the ${tool} config's method, every checkpointing setting and micro-batch on ${target}, ` +
      `${p.get("batch_size") || "the config's"} sequences an optimizer step, ${p.get("seq_len") || "the config's"} tokens each.`;
  }
  return `memfit fit: every method, checkpointing setting and micro-batch for ${p.get("model")} on ${target}, ` +
    `${p.get("batch_size") || "8"} sequences an optimizer step, ${p.get("seq_len") || "2048"} tokens each.`;
}
function fitRow(f, rank) {
  const s = f.spec;
  const row = el("tr", { class: "pick new", title: "plan this configuration" },
    el("td", { class: "num", text: rank === null ? "…" : String(rank) }),
    el("td", { text: s.method }), el("td", { text: s.checkpointing }), el("td", { text: s.optimizer }),
    el("td", { text: `${s.batch_size} × ${s.grad_accum}` }), el("td", { class: "num", text: s.seq_len.toLocaleString("en-US") }),
    el("td", { class: "num", "data-bytes": f.peak.device_total_bytes, text: formatBytes(f.peak.device_total_bytes) }),
    el("td", { class: "num", text: formatBytes(f.headroom_bytes) }),
    el("td", { class: "num", text: rank === null ? "…" : f.relative_speed.toFixed(2) }));
  const yaml = el("button", { type: "button", class: "ghost", text: "YAML" });
  yaml.addEventListener("click", (e) => { e.stopPropagation(); exportText("yaml", "fit", s); });
  row.append(el("td", {}, yaml));
  row.addEventListener("click", () => applySpec(s));
  return row;
}
function applySpec(spec) {
  for (const knob of state.form.knobs) if (knob.name in spec && ["method", "checkpointing", "optimizer", "batch_size", "grad_accum", "precision", "seq_len", "gpus", "shard"].includes(knob.name)) setKnob(knob, spec[knob.name]);
  show("plan");
  changed();
}

async function runFit() {
  const signal = request("fit");
  const body = $("fits").tBodies[0];
  body.replaceChildren();
  $("fit-extra").replaceChildren();
  $("fit-summary").textContent = "searching…";
  $("fit-progress").hidden = false;
  $("fit-start").disabled = true;
  const started = performance.now();
  let expected = null;
  try {
    await ndjson(`/api/fit?${fitParams()}`, (event) => {
      const seconds = ((performance.now() - started) / 1000).toFixed(0);
      if (event.event === "expected") {
        expected = event.plans;
      } else if (event.event === "progress") {
        const of = expected ? ` of about ${Math.max(expected, event.plans)}` : "";
        $("fit-message").textContent = `${seconds} s · plan ${event.plans}${of}: ${event.message}`;
      } else if (event.event === "found") {
        for (const f of event.fits) body.append(fitRow(f, null));
        $("fit-summary").textContent = `${body.rows.length} so far (${event.method} done)`;
      } else if (event.event === "result") {
        renderFit(event.result);
      } else if (event.event === "error") {
        throw new Error(event.error);
      }
    }, signal);
    showError(null);
  } catch (err) {
    if (err.name !== "AbortError") { showError(err.message); $("fit-summary").textContent = "—"; }
  } finally {
    if (!signal.aborted) { $("fit-progress").hidden = true; $("fit-start").disabled = false; }
  }
}
function renderFit(result) {
  const body = $("fits").tBodies[0];
  body.replaceChildren(...result.fits.map((f, i) => fitRow(f, i + 1)));
  for (const row of body.rows) row.classList.remove("new");
  $("fit-summary").textContent = result.fits.length ? `${result.fits.length} on ${result.gpu.name}` : `nothing fits ${result.gpu.name}`;
  $("fit-summary").dataset.count = result.fits.length;
  const longest = Object.entries(result.max_seq_len).map(([method, tokens]) => {
    const spec = result.details.max_seq_len_specs[method];
    return [method, tokens ? `${tokens.toLocaleString("en-US")} tokens${spec ? ` (checkpointing ${spec.checkpointing}, ${spec.optimizer})` : ""}` : "does not fit"];
  });
  const misses = result.details.not_fitting.map((m) => el("p", { class: "muted",
    text: `faster but does not fit: ${m.spec.method}, checkpointing ${m.spec.checkpointing}, ${m.spec.optimizer}, micro-batch ${m.spec.batch_size}: ${formatBytes(m.device_total_bytes)} (${formatBytes(m.over_bytes)} over)` }));
  $("fit-extra").replaceChildren(
    el("dl", {}, el("dt", { text: "longest sequence, micro-batch 1" }), el("dd"), ...longest.flatMap(([k, v]) => [el("dt", { text: k }), el("dd", { text: v })])),
    el("div", { class: "notes" }, ...misses, ...(result.details.notes || []).map((n) => el("p", { class: "muted", text: `note: ${n}` })),
      el("p", { class: "muted", text: `${result.details.plans_made} plans in ${result.details.seconds.toFixed(1)} s. Speed is an estimate relative to the fastest fit; click a row to plan it.` })));
}

// ---- a run against its plan ---------------------------------------------------------------------

function renderRun(data) {
  state.run = data;
  $("run-source").textContent = data.source;
  $("run-status").textContent = data.plan_source ? `against ${data.plan_source}` : data.note ? "measured only (a CPU run)" : "the run has no plan, and none is on the page";
  $("run-help").hidden = true;
  const rows = data.categories.concat(data.peaks);
  $("run-table").hidden = !rows.length;
  $("run-table").tBodies[0].replaceChildren(...rows.map((r) => el("tr", {},
    el("td", {}, r.name in COLORS ? el("span", { class: "swatch", style: `background:${COLORS[r.name]}` }) : "", r.name),
    el("td", { class: "num", text: formatBytes(r.predicted_bytes) }),
    el("td", { class: "num", text: r.measured_bytes === null ? "not measured" : formatBytes(r.measured_bytes) }),
    el("td", { class: "num", text: r.ratio === null ? "—" : r.ratio.toFixed(2) }))));
  const drawn = data.categories.filter((r) => r.measured_bytes !== null);  // what was not measured is in the table
  $("run-chart-box").hidden = !drawn.length;
  if (drawn.length) {
    const datasets = [{ label: "measured", data: drawn.map((r) => gib(r.measured_bytes)), backgroundColor: "#2f5fd0" }];
    if (data.plan_source) datasets.unshift({ label: "plan", data: drawn.map((r) => r.predicted_bytes === null ? null : gib(r.predicted_bytes)), backgroundColor: "#9db4e8" });
    chart("run-chart", {
      type: "bar",
      data: { labels: drawn.map((r) => r.name), datasets },
      options: { maintainAspectRatio: false, animation: false, scales: { y: { ticks: gibTicks } }, plugins: { legend: { position: "bottom" } } },
    });
  }
  const steps = data.steps.filter((s) => s.peak_allocated_bytes !== null);
  $("run-steps-box").hidden = !steps.length;
  if (steps.length) {
    const planned = data.plan ? data.plan.peak : null;
    chart("run-steps", {
      type: "line",
      data: {
        labels: steps.map((s) => s.step),
        datasets: [
          { label: "peak allocated", data: steps.map((s) => gib(s.peak_allocated_bytes)), borderColor: "#2f5fd0", pointRadius: 0 },
          { label: "peak reserved", data: steps.map((s) => s.peak_reserved_bytes === null ? null : gib(s.peak_reserved_bytes)), borderColor: "#76b7b2", pointRadius: 0 },
        ],
      },
      options: {
        maintainAspectRatio: false, animation: false, scales: { y: { min: 0, ticks: gibTicks }, x: { title: { display: true, text: "step" } } },
        plugins: { legend: { position: "bottom" }, cardLine: planned ? { value: gib(planned.allocated_bytes), label: `plan: peak allocated ${formatBytes(planned.allocated_bytes)}` } : null },
      },
      plugins: [cardLinePlugin("y")],
    });
  }
  const notes = [];
  if (data.note) notes.push(el("p", { class: "muted", text: `note: ${data.note}` }));
  for (const f of data.findings) notes.push(el("p", { class: f.severity === "error" ? "tip" : "", text: `${f.severity}: ${f.message} ${f.fix}` }));
  $("run-notes").replaceChildren(...notes);
}
async function loadRunFolder() {  // the --run folder, against the plan on the page when it recorded none
  const body = JSON.stringify({ folder: true, plan: state.plan });
  try { renderRun(await answer(await fetch("/api/run", { method: "POST", body }))); } catch (err) { showError(err.message); }
}

// ---- dropped files ------------------------------------------------------------------------------

async function dropped(files) {
  const texts = [...files].map((f) => ({ name: f.name, size: f.size, file: f }));
  const memory = texts.find((t) => t.name.endsWith(".jsonl"));
  // A model's config.json, or a training config with the DeepSpeed JSON it names: sent together.
  const configs = texts.filter((t) => /\.(json|ya?ml)$/i.test(t.name) && !(memory && t.name === "run.json"));
  const jsons = texts.filter((t) => t.name.endsWith(".json"));
  try {
    if (configs.length) {
      const body = { files: {} };
      for (const t of configs) body.files[t.name] = await t.file.text();
      state.upload = await answer(await fetch("/api/model", { method: "POST", body: JSON.stringify(body) }));
      showUpload();
      resetKnobs();
      changed();
    }
    if (memory) {
      const run = jsons.find((t) => t.name === "run.json");
      const body = { memory: await memory.file.text(), memory_name: memory.name, plan: state.plan };
      if (run) { body.run = await run.file.text(); body.run_name = run.name; }
      renderRun(await answer(await fetch("/api/run", { method: "POST", body: JSON.stringify(body) })));
      show("run");
    }
    if (!memory && !configs.length) throw new Error(`${texts.map((t) => t.name).join(", ")}: drop a config.json, a training config (Axolotl, LLaMA-Factory, TRL), or a run's memory.jsonl and run.json.`);
  } catch (err) {
    showError(err.message);
  }
}
function showUpload() {
  $("upload-chip").hidden = !state.upload;
  $("model").disabled = Boolean(state.upload);
  if (state.upload) {
    const tool = state.upload.tool_title;
    $("upload-name").textContent = tool ? `${state.upload.filename} (${tool}: ${state.upload.base_model})` : `${state.upload.filename} (dropped)`;
    $("upload-name").title = tool ? "the config's knobs fill the form; what you change overrides them, as on the command line" : "";
  }
  $("fit-batch").placeholder = state.upload && state.upload.tool_title ? "the config's" : "8";
}

// ---- views, export, start -----------------------------------------------------------------------

function show(view) {
  state.view = view;
  for (const tab of document.querySelectorAll("[role=tab]")) tab.setAttribute("aria-selected", String(tab.dataset.view === view));
  for (const v of ["plan", "context", "fit", "run"]) $(`view-${v}`).hidden = v !== view;
  writeUrl();
  if (view === "context") refreshContext();
}
async function exportText(kind, command, spec) {
  const params = command === "fit" ? fitParams() : planParams();
  params.set("command", command);
  if (kind === "yaml") params.set("spec", JSON.stringify(spec || (state.plan && state.plan.spec) || {}));
  try {
    const data = await answer(await fetch(`/api/export?${params}`));
    openExport(kind === "yaml" ? "memfit train YAML" : "command line", kind === "yaml" ? data.yaml : data.cli);
  } catch (err) { showError(err.message); }
}
function openExport(title, text) {
  $("export-title").textContent = title;
  $("export-text").value = text;
  $("export-copied").textContent = "";
  $("export").showModal();
}
async function copyExport() {
  try { await navigator.clipboard.writeText($("export-text").value); } catch { $("export-text").select(); document.execCommand("copy"); }
  $("export-copied").textContent = "copied";
}
async function watchWarm() {
  const status = await answer(await fetch("/api/status"));
  const pill = $("warm");
  pill.dataset.state = status.warm ? "ready" : "warming";
  pill.textContent = status.warm ? "planner ready" : "planner warming up…";
  if (!status.warm) setTimeout(watchWarm, 1000);
}

async function start() {
  const form = await answer(await fetch("/api/form"));
  state.form = form;
  $("model-names").replaceChildren(...form.models.map((m) => el("option", { value: m.name, label: `${m.model_type}, ${m.layers} layers` })));
  $("gpu").append(...form.gpus.map((g) => el("option", { value: g.name, text: `${g.display_name} · ${formatBytes(g.memory_bytes)}` })));
  $("main-knobs").replaceChildren(...form.knobs.filter((k) => k.main).map(knobInput));
  $("more-knobs").replaceChildren(...form.knobs.filter((k) => !k.main).map(knobInput));
  const fitBatch = el("input", { id: "fit-batch", inputmode: "numeric", placeholder: "8" });
  $("fit-what").before(el("label", { class: "field", title: "memfit fit --batch-size: sequences per optimizer step, split into micro-batch × accumulation" }, el("span", { text: "effective batch" }), fitBatch));
  fitBatch.addEventListener("input", () => { writeUrl(); $("fit-what").textContent = fitDescription(); });
  const view = await readUrl();
  showUpload();
  for (const id of ["model", "budget"]) $(id).addEventListener("input", changed);
  $("gpu").addEventListener("change", changed);
  for (const tab of document.querySelectorAll("[role=tab]")) tab.addEventListener("click", () => show(tab.dataset.view));
  $("fit-start").addEventListener("click", runFit);
  $("upload-clear").addEventListener("click", () => { state.upload = null; showUpload(); resetKnobs(); changed(); });
  $("copy-link").addEventListener("click", () => openExport("link to this view", location.href));
  $("copy-cli").addEventListener("click", () => exportText("cli", state.view === "fit" ? "fit" : "plan"));
  $("copy-yaml").addEventListener("click", () => exportText("yaml", "plan"));
  $("export-copy").addEventListener("click", copyExport);
  const drop = $("drop");
  $("pick").addEventListener("click", (e) => { e.preventDefault(); $("files").click(); });
  $("files").addEventListener("change", () => dropped($("files").files));
  for (const name of ["dragenter", "dragover"]) document.addEventListener(name, (e) => { e.preventDefault(); drop.classList.add("over"); });
  for (const name of ["dragleave", "drop"]) document.addEventListener(name, () => drop.classList.remove("over"));
  document.addEventListener("drop", (e) => { e.preventDefault(); dropped(e.dataTransfer.files); });
  document.body.dataset.ready = "true";  // the inputs answer from here on (a drop before this is not seen)
  watchWarm();
  $("fit-what").textContent = fitDescription();
  show(view);
  await refreshPlan();
  if (form.run) loadRunFolder();
}
start().catch((err) => showError(err.message));
