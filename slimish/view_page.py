"""The page `slimish view` writes (slimish/view.py): plain HTML, CSS and JS, no network.

`__DATA__` is replaced by the run's data as JSON (`view.read_run`), `__TITLE__` by the run dir.
The JS renders three parts from it: the timeline (an SVG: one lane per phase, bars on a wall-clock
axis, the weight version each push made, the engines' busy share per step), the step list, and the
samples of the chosen steps under the filters. `#step=N` in the URL chooses step N.
"""

PAGE = r"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>slimish view: __TITLE__</title>
<style>
  body { font: 14px/1.4 system-ui, sans-serif; margin: 0; color: #222; background: #fafafa; }
  header { padding: 8px 16px; background: #263238; color: #fff; }
  header h1 { display: inline; font-size: 18px; margin-right: 12px; }
  h2 { font-size: 15px; margin: 12px 0 6px; }
  section, nav { padding: 0 16px; }
  .cols { display: flex; align-items: flex-start; }
  nav { flex: 0 0 auto; max-height: 80vh; overflow-y: auto; }
  #samples-sec { flex: 1 1 auto; min-width: 0; }
  table { border-collapse: collapse; font-size: 13px; }
  th, td { padding: 2px 6px; text-align: right; border-bottom: 1px solid #e0e0e0; }
  tr.step { cursor: pointer; }
  tr.step:hover { background: #eef; }
  tr.step.selected { background: #cfe0ff; }
  tr.step.nosamples td:first-child { color: #999; }
  #timeline-wrap { overflow-x: auto; border: 1px solid #ddd; background: #fff; }
  .ph-rollout { fill: #4c9be8; } .ph-train { fill: #e8884c; } .ph-push { fill: #4caf50; }
  .ph-eval { fill: #a36bd6; } .ph-checkpoint { fill: #888; } .busy { fill: #37474f; }
  .lane-label { font-size: 11px; fill: #555; } .step-label { font-size: 10px; fill: #333; }
  .version { font-size: 10px; fill: #2e7d32; } .step-line { stroke: #ccc; stroke-width: 1; }
  #filters { display: flex; flex-wrap: wrap; gap: 10px; align-items: center; margin-bottom: 8px; }
  #filters input[type=number] { width: 70px; }
  .legend span { margin-right: 12px; }
  .group { border: 1px solid #ccc; background: #fff; margin: 8px 0; padding: 4px 8px; }
  .group-head { font-weight: 600; }
  .traj { border-left: 3px solid #90a4ae; margin: 6px 0 6px 4px; padding-left: 8px; }
  .traj-head { font-size: 12px; color: #455a64; }
  .sample { margin: 4px 0 8px; }
  .sample-head { font-size: 12px; color: #333; }
  .status-completed { color: #2e7d32; } .status-truncated { color: #ef6c00; }
  .status-failed, .status-infra_failed, .status-aborted { color: #c62828; }
  .error { color: #c62828; font-family: monospace; white-space: pre-wrap; }
  .tokens { font-family: ui-monospace, monospace; font-size: 12px; white-space: pre-wrap; word-break: break-all;
            background: #fff; border: 1px solid #eee; padding: 4px; }
  .tok { border-radius: 2px; }
  .tok.p { color: #777; }
  .tok.m1 { border-bottom: 2px solid #1e88e5; }
  .tok.m0 { background: #e0e0e0; color: #333; font-style: italic; }
  .tok.vchange { border-left: 2px solid #2e7d32; }
  .env-span { outline: 1px dashed #9e9e9e; }
  details.meta { font-size: 12px; }
  details.meta pre { margin: 2px 0; }
  .note { color: #777; font-size: 12px; }
</style>
</head>
<body>
<header><h1>slimish view</h1><span id="run"></span></header>
<section id="timeline-sec">
  <h2>Timeline</h2>
  <div class="legend note">bars: <span style="color:#4c9be8">rollout (in async mode: the trainer waiting for its batch)</span>
    <span style="color:#e8884c">train</span> <span style="color:#4caf50">weight push (vN: the version engines serve after it)</span>
    <span style="color:#a36bd6">eval</span> <span style="color:#888">checkpoint</span>
    <span>engines: dark = busy share of the step (1 - rollout/engine_idle_fraction)</span></div>
  <div id="timeline-wrap"><div id="timeline"></div></div>
</section>
<div class="cols">
  <nav id="steps-sec">
    <h2>Steps</h2>
    <table id="step-table"><thead><tr><th>step</th><th>reward</th><th>acc</th><th>len</th><th>s/step</th><th>samples</th></tr></thead>
    <tbody></tbody></table>
  </nav>
  <section id="samples-sec">
    <h2>Samples</h2>
    <form id="filters" onsubmit="return false">
      <label>steps <input type="number" id="f-from"> to <input type="number" id="f-to"></label>
      <label>reward <input type="number" step="any" id="f-rmin" placeholder="min"> to <input type="number" step="any" id="f-rmax" placeholder="max"></label>
      <label>status <select id="f-status"><option value="">any</option></select></label>
      <label>truncated <select id="f-trunc"><option value="">any</option><option value="only">only</option><option value="hide">hide</option></select></label>
    </form>
    <div class="legend note"><span class="tok p">prompt</span> <span class="tok m1">trained (mask 1; red: low log-prob)</span>
      <span class="tok m0">environment (mask 0)</span> <span class="tok m1 vchange">new weight version</span></div>
    <div id="samples"></div>
  </section>
</div>
<script type="application/json" id="data">__DATA__</script>
<script>
"use strict";
const D = JSON.parse(document.getElementById("data").textContent);
const SVG = "http://www.w3.org/2000/svg";
const LIMIT = 300;  // samples rendered at once

function el(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) if (v !== undefined && v !== null) e.setAttribute(k, v);
  for (const k of kids) e.append(k);
  return e;
}
function svg(tag, attrs, text) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}
function fmt(x, digits) { return typeof x === "number" && isFinite(x) ? x.toFixed(digits) : "–"; }
function rewardOf(s) {
  if (typeof s.reward === "number") return s.reward;
  if (s.reward && typeof s.reward === "object") {
    if (typeof s.reward.score === "number") return s.reward.score;
    for (const v of Object.values(s.reward)) if (typeof v === "number") return v;
  }
  return null;
}
function rewardText(s) { return typeof s.reward === "number" ? fmt(s.reward, 3) : JSON.stringify(s.reward); }

// ---- the step list ------------------------------------------------------------------------------
const bySampleStep = new Map();
for (const s of D.samples) { if (!bySampleStep.has(s.step)) bySampleStep.set(s.step, []); bySampleStep.get(s.step).push(s); }
const stepRows = new Map(D.metrics.map(m => [m.step, m]));
for (const t of D.timeline) if (!stepRows.has(t.step)) stepRows.set(t.step, {step: t.step});
for (const s of bySampleStep.keys()) if (!stepRows.has(s)) stepRows.set(s, {step: s});
const steps = [...stepRows.keys()].sort((a, b) => a - b);

function renderSteps() {
  const body = document.querySelector("#step-table tbody");
  for (const step of steps) {
    const m = stepRows.get(step), n = (bySampleStep.get(step) || []).length;
    const tr = el("tr", {class: "step" + (n ? "" : " nosamples"), "data-step": step},
      el("td", {}, String(step)), el("td", {}, fmt(m["reward/mean"], 3)), el("td", {}, fmt(m["eval/accuracy"], 3)),
      el("td", {}, fmt(m["response/length"], 1)), el("td", {}, fmt(m["time/step"], 2)), el("td", {}, String(n)));
    tr.addEventListener("click", () => { location.hash = "step=" + step; });
    body.append(tr);
  }
}

// ---- the timeline -------------------------------------------------------------------------------
function renderTimeline() {
  const box = document.getElementById("timeline");
  const phases = D.timeline.flatMap(t => t.phases.map(p => ({...p, step: t.step})));
  if (!phases.length) { box.append(el("p", {class: "note"}, "no view/timeline.jsonl in this run")); return; }
  const lanes = ["rollout", "train", "push", "eval", "checkpoint", "engines"];
  const t0 = Math.min(...phases.map(p => p.start)), t1 = Math.max(...phases.map(p => p.end));
  const left = 80, laneH = 18, top = 16, width = Math.max(1000, D.timeline.length * 40);
  const x = t => left + (t - t0) / Math.max(t1 - t0, 1e-9) * (width - left - 10);
  const height = top + lanes.length * laneH + 22;
  const root = svg("svg", {width, height, id: "timeline-svg"});
  lanes.forEach((name, i) => root.append(svg("text", {x: 4, y: top + i * laneH + 13, class: "lane-label"}, name)));
  let prevEnd = null;
  for (const t of D.timeline) {
    if (!t.phases.length) continue;
    const start = Math.min(...t.phases.map(p => p.start)), end = Math.max(...t.phases.map(p => p.end));
    root.append(svg("line", {x1: x(start), x2: x(start), y1: top - 4, y2: height - 20, class: "step-line"}));
    root.append(svg("text", {x: x(start) + 2, y: top - 4, class: "step-label"}, String(t.step)));
    for (const p of t.phases) {
      const i = lanes.indexOf(p.name);
      const r = svg("rect", {x: x(p.start), y: top + Math.max(i, 0) * laneH + 2, width: Math.max(x(p.end) - x(p.start), 1),
                             height: laneH - 4, class: "ph ph-" + p.name, "data-step": t.step});
      r.append(svg("title", {}, `step ${t.step} ${p.name}: ${(p.end - p.start).toFixed(3)} s`));
      root.append(r);
      if (p.name === "push" && t.version !== null && t.version !== undefined)
        root.append(svg("text", {x: x(p.end) + 2, y: top + (lanes.length) * laneH + 12, class: "version"}, "v" + t.version));
    }
    if (typeof t.engine_idle_fraction === "number" && prevEnd !== null) {
      const busy = 1 - t.engine_idle_fraction, i = lanes.indexOf("engines");
      const r = svg("rect", {x: x(prevEnd), y: top + i * laneH + 2, width: Math.max(x(end) - x(prevEnd), 1), height: laneH - 4,
                             class: "busy", "fill-opacity": Math.max(0.05, busy).toFixed(3), "data-step": t.step});
      const v = t.trained_versions && t.trained_versions.length ? `, trained on versions ${t.trained_versions.join(",")}` : "";
      r.append(svg("title", {}, `step ${t.step}: engines busy ${(100 * busy).toFixed(0)}% of the interval${v}`));
      root.append(r);
    }
    prevEnd = end;
  }
  root.append(svg("text", {x: left, y: height - 2, class: "lane-label"}, `0 s`));
  root.append(svg("text", {x: width - 60, y: height - 2, class: "lane-label"}, `${(t1 - t0).toFixed(1)} s`));
  box.append(root);
}

// ---- the samples --------------------------------------------------------------------------------
function tokenSpans(part, kind) {
  const out = [];
  let env = null, prevVersion = null;
  for (let i = 0; i < part.ids.length; i++) {
    const piece = (part.pieces[i] ?? "").replace(/\n/g, "↵\n") || "∅";
    if (kind === "prompt") { out.push(el("span", {class: "tok p", title: `prompt id ${part.ids[i]}`}, piece)); continue; }
    const m = part.mask[i], lp = part.logprobs[i], v = part.versions[i];
    let cls = "tok m" + m, style;
    if (m === 1) {
      const surprise = Math.min(1, -(lp ?? 0) / 4);
      style = `background: rgba(229, 57, 53, ${(0.75 * surprise).toFixed(3)})`;
      if (prevVersion !== null && v !== prevVersion) cls += " vchange";
      prevVersion = v;
    }
    const title = `id ${part.ids[i]} | mask ${m}` + (m === 1 ? ` | logprob ${fmt(lp, 3)} (p ${fmt(Math.exp(lp ?? 0), 3)}) | version ${v}` : " | environment");
    const span = el("span", {class: cls, style, title, "data-mask": m}, piece);
    if (m === 0) {
      if (!env) { env = el("span", {class: "env-span"}); out.push(env); }
      env.append(span);
    } else { env = null; out.push(span); }
  }
  return out;
}

function renderSample(s) {
  const mask = s.response.mask, trained = mask.filter(m => m === 1).length;
  const head = el("div", {class: "sample-head"},
    `#${s.index} · `, el("span", {class: "status-" + s.status}, s.status), ` · reward ${rewardText(s)}`,
    ` · weight versions ${s.weight_versions.join(",") || "–"} · ${trained} trained / ${mask.length - trained} environment tokens`,
    s.exclude_from_loss ? " · excluded from loss" : "");
  const box = el("div", {class: "sample", "data-step": s.step, "data-group": s.group_id, "data-index": s.index, "data-status": s.status}, head);
  if (s.error) box.append(el("div", {class: "error"}, s.error));
  if (s.metadata && Object.keys(s.metadata).length)
    box.append(el("details", {class: "meta"}, el("summary", {}, "metadata"), el("pre", {}, JSON.stringify(s.metadata, null, 1))));
  box.append(el("div", {class: "tokens"}, ...tokenSpans(s.prompt, "prompt"), ...tokenSpans(s.response, "response")));
  return box;
}

function filtered() {
  const num = id => { const v = document.getElementById(id).value; return v === "" ? null : Number(v); };
  const from = num("f-from"), to = num("f-to"), rmin = num("f-rmin"), rmax = num("f-rmax");
  const status = document.getElementById("f-status").value, trunc = document.getElementById("f-trunc").value;
  return D.samples.filter(s => {
    const r = rewardOf(s);
    return (from === null || s.step >= from) && (to === null || s.step <= to)
      && (rmin === null || (r !== null && r >= rmin)) && (rmax === null || (r !== null && r <= rmax))
      && (!status || s.status === status)
      && (trunc !== "only" || s.status === "truncated") && (trunc !== "hide" || s.status !== "truncated");
  });
}

function renderSamples() {
  const box = document.getElementById("samples");
  box.replaceChildren();
  const from = document.getElementById("f-from").value, to = document.getElementById("f-to").value;
  document.querySelectorAll("tr.step").forEach(tr => {
    const st = Number(tr.dataset.step);
    tr.classList.toggle("selected", (from === "" || st >= Number(from)) && (to === "" || st <= Number(to)));
  });
  if (!D.samples.length) { box.append(el("p", {class: "note"}, "no samples in view/samples.jsonl (metrics.view_groups = 0, or a run from before it)")); return; }
  const shown = filtered();
  if (D.sample_steps_total > new Set(D.samples.map(s => s.step)).size)
    box.append(el("p", {class: "note"}, `samples of ${bySampleStep.size} of ${D.sample_steps_total} steps embedded (slimish view --sample-steps)`));
  box.append(el("p", {class: "note", id: "sample-count"}, `${shown.length} samples match` + (shown.length > LIMIT ? `; the first ${LIMIT} shown` : "")));
  // By step and group, then by trajectory (the segments and fan-out siblings of one rollout).
  const groups = new Map();
  for (const s of shown.slice(0, LIMIT)) {
    const key = s.step + "/" + s.group_id;
    if (!groups.has(key)) groups.set(key, []);
    groups.get(key).push(s);
  }
  for (const members of groups.values()) {
    const rewards = members.map(rewardOf).filter(r => r !== null);
    const mean = rewards.length ? rewards.reduce((a, b) => a + b, 0) / rewards.length : null;
    const g = el("div", {class: "group", "data-step": members[0].step, "data-group": members[0].group_id},
      el("div", {class: "group-head"}, `step ${members[0].step} · group ${members[0].group_id} · ${members.length} samples · mean reward ${fmt(mean, 3)}`));
    const trajs = new Map();
    for (const s of members) { const t = s.trajectory_id ?? `${s.group_id}-${s.index}`; if (!trajs.has(t)) trajs.set(t, []); trajs.get(t).push(s); }
    for (const [tid, segs] of trajs) {
      const t = el("div", {class: "traj", "data-trajectory": tid},
        el("div", {class: "traj-head"}, `trajectory ${tid}` + (segs.length > 1 ? ` · ${segs.length} segments / branches` : "")));
      for (const s of segs) t.append(renderSample(s));
      g.append(t);
    }
    box.append(g);
  }
}

function chooseStep() {
  const m = /step=(-?\d+)/.exec(location.hash);
  const withSamples = [...bySampleStep.keys()];
  const step = m ? Number(m[1]) : (withSamples.length ? Math.max(...withSamples) : null);
  document.getElementById("f-from").value = step === null ? "" : step;
  document.getElementById("f-to").value = step === null ? "" : step;
  renderSamples();
}

document.getElementById("run").textContent = D.run_dir + ` · ${steps.length} steps`;
const statusSel = document.getElementById("f-status");
for (const st of [...new Set(D.samples.map(s => s.status))].sort()) statusSel.append(el("option", {value: st}, st));
document.getElementById("filters").addEventListener("input", renderSamples);
window.addEventListener("hashchange", chooseStep);
renderTimeline();
renderSteps();
chooseStep();
</script>
</body>
</html>
"""
