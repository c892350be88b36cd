// The fleet page's live table: rows from /console/nodes/stream (server-sent events),
// built with text nodes only (never HTML from data). Without script the page still works:
// it shows the rows of its last load, and the filters are a plain form.
"use strict";
(function () {
  const table = document.querySelector("table[data-stream]");
  if (!table || !window.EventSource) return;
  const body = document.getElementById("fleet-rows");
  const live = document.getElementById("live");
  const columns = 8;

  function cell(text, className) {
    const td = document.createElement("td");
    if (className) td.className = className;
    td.textContent = text;
    return td;
  }

  function badge(text, status) {
    const span = document.createElement("span");
    span.className = "status status-" + status;
    span.textContent = text;
    return span;
  }

  function row(r) {
    const tr = document.createElement("tr");
    tr.dataset.node = r.name;
    tr.dataset.status = r.status;
    const name = document.createElement("td");
    const link = document.createElement("a");
    link.href = "/console/nodes/" + encodeURIComponent(r.id);
    link.textContent = r.name;
    name.appendChild(link);
    tr.appendChild(name);
    tr.appendChild(cell(r.site));
    const status = document.createElement("td");
    status.appendChild(badge(r.status, r.status));
    if (r.draining) {
      status.appendChild(document.createTextNode(" "));
      status.appendChild(badge("draining", "draining"));
    }
    tr.appendChild(status);
    tr.appendChild(cell(r.version));
    tr.appendChild(cell(r.load, "num"));
    tr.appendChild(cell(r.queue, "num"));
    tr.appendChild(cell(r.outbox_lag, r.outbox_alarm ? "num alarm" : "num"));
    tr.appendChild(cell(r.last_seen));
    return tr;
  }

  function show(data) {
    const rows = data.rows.map(row);
    if (rows.length === 0) {
      const tr = document.createElement("tr");
      tr.className = "empty";
      const td = cell("No node matches.");
      td.colSpan = columns;
      tr.appendChild(td);
      rows.push(tr);
    }
    body.replaceChildren(...rows);
    let total = 0;
    for (const [status, count] of Object.entries(data.counts)) {
      total += count;
      const span = document.querySelector('[data-count="' + status + '"]');
      if (span) span.textContent = String(count);
    }
    const set = (name, value) => {
      const span = document.querySelector('[data-count="' + name + '"]');
      if (span) span.textContent = String(value);
    };
    set("total", total);
    set("shown", data.rows.length);
    set("matched", data.matched);
  }

  const source = new EventSource(table.dataset.stream);
  source.addEventListener("nodes", (e) => {
    show(JSON.parse(e.data));
    live.textContent = "(live, updated " + new Date().toLocaleTimeString() + ")";
  });
  source.addEventListener("logout", () => { source.close(); window.location.reload(); });
  source.addEventListener("error", () => {
    live.textContent = "(reconnecting…)";
  });
})();

// The rollouts page, live: each rollout's phase and reason, and each node's state, image
// and status, from /console/rollouts/stream (text only, as above). A rollout the page does
// not show yet, or one whose state changes which steps it takes, has the list rendered
// again by the server (its forms carry their CSRF token) and put in place, with no reload.
(function () {
  const root = document.querySelector("#rollouts[data-stream]");
  if (!root || !window.EventSource) return;
  const live = document.getElementById("rollouts-live");
  let refreshing = false;

  async function refresh() {
    if (refreshing) return;
    refreshing = true;
    try {
      const answer = await fetch("/console/rollouts", { credentials: "same-origin" });
      if (!answer.ok) return;
      const doc = new DOMParser().parseFromString(await answer.text(), "text/html");
      const fresh = doc.querySelector("#rollouts");
      if (fresh) root.replaceChildren(...Array.from(fresh.childNodes, (n) => document.importNode(n, true)));
    } catch (err) {
      live.textContent = "(reconnecting…)";
    } finally {
      refreshing = false;
    }
  }

  function stale(data) {
    return data.rollouts.some((r) => {
      const section = root.querySelector('[data-rollout="' + r.id + '"]');
      return !section || section.dataset.state !== r.state;
    });
  }

  function set(scope, field, text) {
    const el = scope.querySelector('[data-field="' + field + '"]');
    if (el && el.textContent !== text) el.textContent = text;
  }

  function show(data) {
    for (const r of data.rollouts) {
      const section = root.querySelector('[data-rollout="' + r.id + '"]');
      if (!section) continue;
      set(section, "phase", r.phase);
      set(section, "reason", r.reason);
      for (const w of r.waves) {
        const updated = "(" + w.updated + "/" + w.nodes.length + ")";
        set(section, "wave-" + w.wave, updated);
        for (const n of w.nodes) {
          const row = section.querySelector('[data-node="' + r.id + "/" + n.id + '"]');
          if (!row) continue;
          set(row, "state", n.state);
          set(row, "running", n.running);
          set(row, "update", n.update);
          set(row, "status", n.status);
          set(row, "heard", n.heard);
          set(row, "note", n.note);
        }
      }
    }
  }

  const source = new EventSource(root.dataset.stream);
  source.addEventListener("rollouts", (e) => {
    const data = JSON.parse(e.data);
    if (stale(data)) refresh();
    show(data);
    live.textContent = "(live, updated " + new Date().toLocaleTimeString() + ")";
  });
  source.addEventListener("logout", () => { source.close(); window.location.reload(); });
  source.addEventListener("error", () => { live.textContent = "(reconnecting…)"; });
})();
