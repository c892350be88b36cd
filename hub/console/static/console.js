// The fleet page's live table: rows from /console/nodes/stream (server-sent events),
// built with text nodes only (never HTML from data). Without script the page still works:
// it shows the rows of its last load, and the filters are a plain form.
"use strict";
(function () {
  const table = document.querySelector("table[data-stream]");
  if (!table || !window.EventSource) return;
  const body = document.getElementById("fleet-rows");
  const live = document.getElementById("live");
  const columns = 9;

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
    tr.appendChild(cell(r.backup + (r.backup_overdue ? " (overdue)" : ""), r.backup_overdue ? "alarm" : ""));
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

// The models page, live: the pulls' and uploads' progress from /console/models/stream (text
// only, as above: each row rebuilt with textContent). And the upload form: the file sent in
// pieces of 8 MiB to /console/models/uploads (the session's CSRF token in a header), each at
// the offset where the upload stands; a piece cut off is sent again from where the hub says
// the upload stands, so a flaky link costs a piece, not the file.
(function () {
  const root = document.querySelector("#models-progress[data-stream]");
  if (!root || !window.EventSource) return;
  const live = document.getElementById("models-live");
  const rows = document.getElementById("models-rows");

  function size(bytes) {
    if (bytes === null || bytes === undefined) return "-";
    if (bytes < 1024 * 1024) return (bytes / 1024).toFixed(1) + " KiB";
    if (bytes < 1024 * 1024 * 1024) return (bytes / 1048576).toFixed(1) + " MiB";
    return (bytes / 1073741824).toFixed(1) + " GiB";
  }

  function row(cells) {
    const tr = document.createElement("tr");
    for (const text of cells) {
      const td = document.createElement("td");
      td.textContent = text;
      tr.appendChild(td);
    }
    return tr;
  }

  const source = new EventSource(root.dataset.stream);
  source.addEventListener("models", (e) => {
    const data = JSON.parse(e.data);
    const fresh = [];
    for (const p of data.pulls) {
      const done = size(p.done) + (p.total ? " of " + size(p.total) : "");
      fresh.push(row([p.reference, p.state, done, p.model || p.error || ""]));
    }
    for (const u of data.uploads) {
      fresh.push(row(["upload " + u.name, u.state, size(u.total), u.model || u.error || ""]));
    }
    if (fresh.length) rows.replaceChildren(...fresh);
    live.textContent = "(live, updated " + new Date().toLocaleTimeString() + ")";
  });
  source.addEventListener("logout", () => { source.close(); window.location.reload(); });
  source.addEventListener("error", () => { live.textContent = "(reconnecting…)"; });
})();

(function () {
  const form = document.getElementById("upload");
  if (!form) return;
  const bar = document.getElementById("upload-progress");
  const status = document.getElementById("upload-status");
  const PIECE = 8 * 1024 * 1024;
  const headers = { "X-CSRF-Token": form.dataset.csrf };

  async function send(url, upload, file) {
    let offset = upload.offset;
    let tries = 0;
    while (offset < file.size) {
      const piece = file.slice(offset, Math.min(offset + PIECE, file.size));
      let answer;
      try {
        answer = await fetch(url, {
          method: "PATCH", credentials: "same-origin", body: piece,
          headers: { ...headers, "Upload-Offset": String(offset), "Content-Type": "application/offset+octet-stream" },
        });
      } catch (err) {
        if (++tries > 5) throw new Error("the link to the hub keeps failing");
        await new Promise((r) => setTimeout(r, 1000 * tries));
        try {
          const seen = await fetch(url, { credentials: "same-origin", headers });
          if (seen.ok) offset = (await seen.json()).offset;
        } catch (again) { /* the next try asks again */ }
        continue;
      }
      const body = await answer.json();
      if (!answer.ok) {
        const stands = /stands at (\d+) bytes/.exec(body.error.message);
        if (answer.status === 409 && stands) { offset = Number(stands[1]); continue; }
        throw new Error(body.error.message);
      }
      tries = 0;
      offset = body.offset;
      bar.value = offset / file.size;
      status.textContent = size(offset) + " of " + size(file.size);
      if (body.state !== "open") return body;
    }
    return null;
  }

  function size(bytes) { return (bytes / 1048576).toFixed(1) + " MiB"; }

  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const file = form.elements.file.files[0];
    if (!file) return;
    bar.hidden = false;
    status.textContent = "starting…";
    try {
      const made = await fetch(form.dataset.uploads, {
        method: "POST", credentials: "same-origin",
        headers: { ...headers, "Content-Type": "application/json" },
        body: JSON.stringify({ name: form.elements.name.value, version: form.elements.version.value, size_bytes: file.size }),
      });
      const upload = await made.json();
      if (!made.ok) throw new Error(upload.error.message);
      const done = await send(form.dataset.uploads + "/" + upload.id, upload, file);
      status.textContent = done && done.model ? "registered " + done.model : "uploaded";
    } catch (err) {
      status.textContent = "not uploaded: " + err.message;
    }
  });
})();
