// arendez-server dashboard: fetches /status every second and renders one panel per job.
"use strict";

const REFRESH_MS = 1000;
const MAX_ROWS = 512; // larger rounds show their non-active ranks and a count of the rest
const token = new URLSearchParams(location.hash.slice(1)).get("token");

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, value);
  for (const child of children) node.append(child);
  return node;
}

function count(n, what) {
  return n + " " + what + (n === 1 ? "" : "s");
}

function time(seconds) {
  return new Date(seconds * 1000).toLocaleTimeString();
}

function roundTable(round) {
  const shown = round.members.length > MAX_ROWS ? round.members.filter((m) => m.state !== "active") : round.members;
  const table = el("table", { class: "ranks" },
    el("tr", {}, el("th", {}, "rank"), el("th", {}, "state"), el("th", {}, "lease age"), el("th", {}, "address")));
  for (const m of shown) {
    table.append(el("tr", { "data-rank": String(m.rank), "data-state": m.state },
      el("td", { class: "num" }, String(m.rank)),
      el("td", {}, el("span", { class: "state state-" + m.state }, m.state)),
      el("td", { class: "num" }, m.lease_age.toFixed(1) + " s"),
      el("td", {}, m.address)));
  }
  const hidden = round.members.length - shown.length;
  return hidden ? [table, el("div", { class: "meta" }, count(hidden, "more active rank"))] : [table];
}

function jobPanel(job) {
  // failures declared recently (the server keeps a job's last events), whether or not the round is over
  const failures = job.events.filter((e) => e.kind === "failed").length;
  const panel = el("section", { class: "job" + (failures ? " has-failed" : ""), "data-job": job.name },
    el("h2", {}, "job " + job.name + (job.ended ? " (ended)" : "")),
    el("div", { class: "meta" }, job.ended ? "ended: its ranks are gone; " + count(failures, "failure") + " in its last events"
      : count(job.keys, "key") + ", " + count(job.bytes, "byte") + " stored, " + count(failures, "failure")));
  for (const round of job.rounds) {
    const what = round.complete ? "round " + round.id : "forming: " + round.members.length + "/" + round.world_size + " joined";
    panel.append(el("div", { class: "meta" }, what + ", world size " + round.world_size), ...roundTable(round));
  }
  if (job.events.length) {
    const list = el("ul", { class: "events" });
    for (const e of job.events.slice().reverse()) {
      list.append(el("li", { class: e.kind }, time(e.time) + " rank " + e.rank + " " + e.kind + ": " + e.reason));
    }
    panel.append(el("div", { class: "meta" }, "recent events"), list);
  }
  return panel;
}

function render(status) {
  const ranks = status.jobs.flatMap((j) => j.rounds).reduce((n, r) => n + r.members.length, 0);
  const running = status.jobs.filter((j) => !j.ended).length;
  document.getElementById("summary").textContent =
    status.url + " \u2014 " + [count(running, "job"), count(ranks, "rank"), count(status.connections, "connection")].join(", ");
  const updated = document.getElementById("updated");
  updated.textContent = status.holding_declarations
    ? "updated " + time(status.time) + " \u2014 no client heard: failure declarations on hold"
    : "updated " + time(status.time);
  updated.className = status.holding_declarations ? "stale" : "";
  document.getElementById("jobs").replaceChildren(...status.jobs.map(jobPanel));
}

async function refresh() {
  try {
    const reply = await fetch("status", { headers: token ? { Authorization: "Bearer " + token } : {}, cache: "no-store" });
    if (!reply.ok) throw new Error("HTTP " + reply.status + " " + (await reply.text()));
    render(await reply.json());
  } catch (err) {
    const updated = document.getElementById("updated");
    updated.textContent = "cannot refresh: " + err.message;
    updated.className = "stale";
  } finally {
    setTimeout(refresh, REFRESH_MS);
  }
}

refresh();
