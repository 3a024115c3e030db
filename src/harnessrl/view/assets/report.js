// harnessrl view: index first, one rollout on demand. No external resources.
(function () {
  "use strict";
  const DATA = JSON.parse(document.getElementById("hrl-index").textContent);
  const MODE = document.body.dataset.mode; // "server" (fetch JSON) or "static" (script files)
  const PREFERRED = [
    ["verifier reward", ["reward/verifier_mean", "verifier_reward_mean", "reward_verifier_mean"]],
    ["training reward", ["reward/train_mean", "reward_mean", "train_reward_mean"]],
    ["pass rate", ["pass_rate"]],
    ["staleness", ["staleness_mean", "staleness_max"]],
    ["clip fraction", ["clip_frac", "clip_high_frac", "clip_low_frac", "is_truncated_frac"]],
    ["CLEAN fraction", ["samples/frac_clean", "samples/frac_bridged", "frac_clean"]],
    ["REALIGN / FORK", ["samples/frac_realign", "samples/frac_fork"]],
    ["rows per rollout", ["samples/rows_per_rollout"]],
    ["trained tokens by turn", ["samples/trained_token_share/turn_1", "samples/trained_token_share/turn_2",
                                "samples/trained_token_share/turn_3", "samples/trained_token_share/turn_4plus"]],
    ["untrained sampled tokens", ["untrained_sampled_tokens", "samples/tokens_untrained_by_realign"]],
    ["rows past a rollout's bound (dropped)", ["rows_capped_dropped", "rollouts_capped"]],
  ];
  const el = (tag, attrs, ...kids) => {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "class") e.className = v; else if (k === "text") e.textContent = v;
      else if (k.startsWith("on")) e.addEventListener(k.slice(2), v); else e.setAttribute(k, v);
    }
    for (const k of kids) if (k != null) e.append(k);
    return e;
  };
  const fmt = (v, d = 3) => v == null ? "–" : (typeof v === "number" ? (Number.isInteger(v) ? String(v) : v.toFixed(d)) : String(v));

  // ---- curves ----------------------------------------------------------------------------
  function numericKeys() {
    const keys = new Set();
    for (const m of DATA.metrics) for (const [k, v] of Object.entries(m)) if (typeof v === "number" && k !== "step") keys.add(k);
    return [...keys].sort();
  }
  function chart(title, keys) {
    const W = 260, H = 120, P = 24, colors = ["#1f6feb", "#d1242f", "#8250df", "#1a7f37"];
    const series = keys.map(k => DATA.metrics.map(m => [m.step, m[k]]).filter(p => typeof p[1] === "number" && isFinite(p[1])));
    const pts = series.flat();
    const box = el("div", { class: "chart", "data-metric": keys.join(",") }, el("div", { class: "title", text: title + " (" + keys.join(", ") + ")" }));
    const ns = "http://www.w3.org/2000/svg";
    const svg = document.createElementNS(ns, "svg"); svg.setAttribute("width", W); svg.setAttribute("height", H);
    if (pts.length) {
      const xs = pts.map(p => p[0]), ys = pts.map(p => p[1]);
      let x0 = Math.min(...xs), x1 = Math.max(...xs), y0 = Math.min(...ys), y1 = Math.max(...ys);
      if (x1 === x0) { x0 -= 1; x1 += 1; } if (y1 === y0) { y0 -= 0.5; y1 += 0.5; }
      const X = x => P + (x - x0) / (x1 - x0) * (W - P - 6), Y = y => H - 14 - (y - y0) / (y1 - y0) * (H - 24);
      const text = (x, y, s, anchor) => { const t = document.createElementNS(ns, "text"); t.setAttribute("x", x); t.setAttribute("y", y); t.setAttribute("font-size", "9"); t.setAttribute("fill", "#667"); if (anchor) t.setAttribute("text-anchor", anchor); t.textContent = s; svg.append(t); };
      text(2, 12, fmt(y1, 2)); text(2, H - 14, fmt(y0, 2)); text(P, H - 2, "step " + x0); text(W - 4, H - 2, String(x1), "end");
      series.forEach((s, n) => {
        const pl = document.createElementNS(ns, "polyline");
        pl.setAttribute("points", s.map(p => X(p[0]) + "," + Y(p[1])).join(" "));
        pl.setAttribute("fill", "none"); pl.setAttribute("stroke", colors[n % 4]); pl.setAttribute("stroke-width", "1.5");
        svg.append(pl);
        for (const p of s) { const c = document.createElementNS(ns, "circle"); c.setAttribute("cx", X(p[0])); c.setAttribute("cy", Y(p[1])); c.setAttribute("r", "2"); c.setAttribute("fill", colors[n % 4]); const t = document.createElementNS(ns, "title"); t.textContent = keys[n] + " @ step " + p[0] + ": " + p[1]; c.append(t); svg.append(c); }
      });
    } else { const t = document.createElementNS(ns, "text"); t.setAttribute("x", 8); t.setAttribute("y", 60); t.textContent = "no finite values"; svg.append(t); }
    box.append(svg);
    return box;
  }
  function renderCurves() {
    const root = document.getElementById("curves");
    root.innerHTML = "";
    if (!DATA.metrics.length) { root.append(el("div", { class: "muted", text: "No metrics.jsonl in this run (an evaluation run): no curves." })); return; }
    if (DATA.curve_png) root.append(el("img", { class: "figure", id: "curve-png", alt: "learning curve (curve.png)", src: "data:image/png;base64," + DATA.curve_png }));
    const have = new Set(numericKeys());
    for (const [title, keys] of PREFERRED) { const k = keys.filter(x => have.has(x)); if (k.length) root.append(chart(title, k)); }
    const pick = el("select", { id: "metric-pick" }, el("option", { value: "", text: "add a curve…" }));
    for (const k of have) pick.append(el("option", { value: k, text: k }));
    pick.addEventListener("change", () => { if (pick.value) root.insertBefore(chart(pick.value, [pick.value]), pick.parentNode); pick.value = ""; });
    root.append(el("div", { class: "chart" }, pick));
  }

  // ---- rollout list ----------------------------------------------------------------------
  const F = { step: "", status: "", task: "", rmin: "", rmax: "" };
  const MAX_SHOWN = 300;
  const FOLD_AT = 400, FOLD_HEAD = 60, FOLD_TAIL = 160;
  function renderFilters() {
    const root = document.getElementById("filters");
    const steps = [...new Set(DATA.rollouts.map(r => r.step))].filter(s => s != null).sort((a, b) => a - b);
    const statuses = [...new Set(DATA.rollouts.map(r => r.status))].sort();
    const sel = (name, vals) => { const s = el("select", { id: "f-" + name }, el("option", { value: "", text: "all" })); for (const v of vals) s.append(el("option", { value: String(v), text: String(v) })); s.addEventListener("change", () => { F[name] = s.value; renderList(); }); return s; };
    const inp = (name, cls, ph) => { const i = el("input", { id: "f-" + name, class: cls || "", placeholder: ph || "" }); i.addEventListener("input", () => { F[name] = i.value; renderList(); }); return i; };
    root.append(el("label", { text: "step " }, sel("step", steps)), el("label", { text: "status " }, sel("status", statuses)),
      el("label", { text: "task " }, inp("task", "task", "contains")), el("label", { text: "reward ≥ " }, inp("rmin")), el("label", { text: "≤ " }, inp("rmax")));
  }
  function matches(r) {
    if (F.step && String(r.step) !== F.step) return false;
    if (F.status && r.status !== F.status) return false;
    if (F.task && !r.task_id.includes(F.task)) return false;
    if (F.rmin !== "" && !(r.reward != null && r.reward >= Number(F.rmin))) return false;
    if (F.rmax !== "" && !(r.reward != null && r.reward <= Number(F.rmax))) return false;
    return true;
  }
  function renderList() {
    const tbody = document.getElementById("list-body");
    tbody.innerHTML = "";
    const hits = DATA.rollouts.filter(matches);
    document.getElementById("list-count").textContent = hits.length + " of " + DATA.rollouts.length + " rollouts" + (hits.length > MAX_SHOWN ? " (first " + MAX_SHOWN + " shown)" : "");
    for (const r of hits.slice(0, MAX_SHOWN)) {
      const flags = (r.error_turns ? "err×" + r.error_turns + " " : "") + (r.unfaithful_turns ? "unfaithful×" + r.unfaithful_turns : "");
      const tr = el("tr", { class: "rollout", "data-i": r.i, "data-rollout-id": r.rollout_id, onclick: () => openRollout(r.i) },
        el("td", { text: r.i }), el("td", { text: fmt(r.step) }), el("td", { text: r.group_id }), el("td", { text: r.task_id }),
        el("td", { class: "st-" + r.status, text: r.status }), el("td", { text: fmt(r.reward) }), el("td", { text: fmt(r.advantage) }),
        el("td", { text: r.turns }), el("td", { text: r.completion_tokens }), el("td", { class: "warn", text: flags }));
      tbody.append(tr);
    }
  }

  // ---- one rollout -----------------------------------------------------------------------
  const cache = new Map();
  window.hrlRollout = function (i, data) { const w = cache.get(i); cache.set(i, data); if (w && w.resolve) w.resolve(data); };
  function load(i) {
    const got = cache.get(i);
    if (got && !got.resolve) return Promise.resolve(got);
    if (MODE === "server") return fetch("api/rollout/" + i + ".json").then(r => { if (!r.ok) throw new Error("HTTP " + r.status); return r.json(); });
    return new Promise((resolve, reject) => {
      cache.set(i, { resolve });
      const s = el("script", { src: "rollouts/" + i + ".js" });
      s.onerror = () => reject(new Error("rollouts/" + i + ".js did not load"));
      document.head.append(s);
    });
  }
  function openRollout(i) {
    document.querySelectorAll("tr.rollout.sel").forEach(t => t.classList.remove("sel"));
    const tr = document.querySelector('tr.rollout[data-i="' + i + '"]'); if (tr) tr.classList.add("sel");
    const root = document.getElementById("detail");
    root.innerHTML = ""; root.append(el("div", { class: "muted", text: "loading rollout " + i + "…" }));
    load(i).then(d => renderDetail(i, d)).catch(e => { root.innerHTML = ""; root.append(el("div", { class: "warn", text: String(e) })); });
  }
  function renderDetail(i, d) {
    const root = document.getElementById("detail");
    root.innerHTML = ""; root.dataset.i = i;
    const s = d.summary;
    root.append(el("h2", { text: "rollout " + i + " · " + s.task_id }),
      el("div", {}, el("span", { class: "st-" + s.status, text: s.status }), " · reward " + fmt(s.reward) + " · training reward " + fmt(s.train_reward) +
        " · advantage " + fmt(s.advantage) + " · group " + s.group_id + " · step " + fmt(s.step) + " · id " + s.rollout_id));
    if (d.error) root.append(el("div", { class: "warn", text: "error: " + d.error }));
    if (d.dropped_by_trainer) root.append(el("div", { class: "warn", text: d.dropped_by_trainer }));
    const st = d.stats;
    root.append(el("div", { class: "muted", text: "builder: " + fmt(st["samples/num_rows"]) + " rows, " + fmt(st["samples/tokens_trained"]) + " trained of " + fmt(st["samples/tokens_total"]) + " tokens; CLEAN " + fmt(st["samples/frac_clean"], 2) + ", REALIGN " + fmt(st["samples/frac_realign"], 2) + ", FORK " + fmt(st["samples/frac_fork"], 2) + (st["samples/untrained_sampled_tokens"] != null ? "; untrained sampled tokens " + fmt(st["samples/untrained_sampled_tokens"]) : "") }));
    root.append(el("h2", { text: "Turns, as the agent saw them" }));
    for (const t of d.turns) root.append(renderTurn(t));
    root.append(el("h2", { text: "Training rows (" + d.rows.length + "), as they train" }),
      el("div", { class: "legend" }, el("span", { class: "tok ctx", text: "context" }), el("span", { class: "tok tr pos", text: "trained, advantage > 0" }),
        el("span", { class: "tok tr neg", text: "trained, advantage < 0" }), el("span", { class: "tok tr zero", text: "trained, advantage 0" }),
        el("span", { class: "tok tr zero clipped", text: "clipped" }), el("span", { class: "tok tr zero bounded", text: "weight truncated / masked" }),
        el("span", { class: "muted", text: "hover a token: id, logprob, policy version, loss weight" })));
    d.rows.forEach((r, k) => root.append(renderRow(k, r, d.vocab)));
  }
  function renderTurn(t) {
    const bad = t.excluded === "error" || t.excluded === "unfaithful";
    const head = el("div", { class: "head" }, "turn " + t.turn_index + " ",
      t.merge ? el("span", { class: "flag kind-" + t.merge, text: t.merge.toUpperCase() }) : null,
      t.main === false ? el("span", { class: "flag aux", text: "auxiliary" + (t.request_kind ? " (" + t.request_kind + ")" : "") }) : null,
      ...(t.notes || []).filter(n => n.startsWith("bridged_from=")).map(n => el("span", { class: "flag kind-clean", text: "bridged from turn " + n.slice(13) })),
      t.excluded ? el("span", { class: "flag " + t.excluded, text: "not trained: " + t.excluded }) : null,
      el("span", { class: "muted", text: "  " + t.protocol + " · prompt " + t.prompt_tokens + " · completion " + t.completion_tokens + " · " + (t.finish_reason || "") + " · v" + t.policy_version + (t.row != null ? " · row " + t.row + " · trained " + t.trained_tokens : "") }));
    const box = el("div", { class: "turn" + (bad ? " bad" : ""), "data-turn": t.turn_index }, head);
    if (t.error) box.append(el("div", { class: "warn", text: "error: " + t.error }));
    if (t.unfaithful_reason) box.append(el("div", { class: "warn", text: "unfaithful: " + t.unfaithful_reason }));
    for (const n of (t.notes || []).filter(n => !n.startsWith("bridged_from="))) box.append(el("div", { class: "muted", text: "note: " + n }));
    if (t.messages_from > 0) box.append(el("div", { class: "muted", text: "(" + t.messages_from + " earlier messages as in the previous call)" }));
    for (const m of t.messages) box.append(el("div", { class: "msg" }, el("span", { class: "role", text: m.role }), el("pre", { text: m.text })));
    box.append(el("div", { class: "reply" }, el("span", { class: "role", text: "reply" }), el("pre", { text: t.reply == null ? "(none)" : t.reply })));
    return box;
  }
  function renderRow(k, r, vocab) {
    const sign = r.advantage > 0 ? "pos" : (r.advantage < 0 ? "neg" : "zero");
    const box = el("div", { class: "row", "data-row": k, "data-trained-ids": r.trained_ids.join(",") },
      el("div", { class: "head", text: "row " + k + " · " + r.ids.length + " tokens, " + r.trained_ids.length + " trained · advantage " + fmt(r.advantage) }));
    for (const dv of r.divergences || []) {
      const sg = r.segments.find(s => s.turn_index === dv.turn_index);
      box.append(el("div", { class: "divergence warn", "data-turn": dv.turn_index, "data-position": dv.position,
        text: (sg ? sg.kind.toUpperCase() + " " : "") + "turn " + dv.turn_index + ": its prompt diverges from the previous turn's ids at position " + dv.position }));
    }
    const marks = new Map();
    for (const sg of r.segments) {
      const at = sg.kind === "start" || sg.kind === "fork" || sg.kind === "auxiliary" ? 0 : sg.context_start;
      if (!marks.has(at)) marks.set(at, []);
      marks.get(at).push(sg);
    }
    // the loss's weight on each trained token and whether the clip or the weight's bound
    // stopped it (the trainer's token_weights.jsonl), by position among the trained tokens
    const wt = r.weights, ordOf = new Map();
    if (wt) {
      let c = 0;
      for (let t = 0; t < r.ids.length; t++) if (r.mask[t] === 1) ordOf.set(t, c++);
      const n = (v) => Array.isArray(v) ? v.length : v;
      box.querySelector(".head").textContent += " · trained at step " + wt.step + ": " + n(wt.clipped) + " clipped, " + n(wt.bounded) + " weight-bounded";
    }
    const clipped = new Set(wt && Array.isArray(wt.clipped) ? wt.clipped : []), bounded = new Set(wt && Array.isArray(wt.bounded) ? wt.bounded : []);
    const weightNote = (t, span) => {
      if (!wt || !ordOf.has(t)) return "";
      const o = ordOf.get(t), w = wt.w ? wt.w[o] : null;
      if (w != null) span.dataset.w = w;
      if (clipped.has(o)) span.classList.add("clipped");
      if (bounded.has(o)) span.classList.add("bounded");
      return (w != null ? " · weight " + w : "") + (clipped.has(o) ? " · clipped (no gradient)" : "") + (bounded.has(o) ? " · weight truncated or masked" : "");
    };
    const toks = el("div", { class: "tokens" });
    const frag = document.createDocumentFragment();
    const emit = (into, a, b) => {
      for (let t = a; t < b; t++) {
        for (const sg of marks.get(t) || []) into.append(el("span", { class: "mark kind-" + sg.kind, "data-kind": sg.kind, text: sg.kind.toUpperCase() + " turn " + sg.turn_index }));
        const id = r.ids[t], tr = r.mask[t] === 1;
        const span = document.createElement("span");
        span.className = tr ? "tok tr " + sign : "tok ctx";
        span.dataset.id = id; span.dataset.pos = t;
        span.title = "id " + id + " · pos " + t + (tr ? " · logprob " + r.lp[t] + " · v" + r.ver[t] + weightNote(t, span) : " · context");
        span.textContent = vocab[id] ?? ("<" + id + ">");
        into.append(span);
      }
    };
    // long runs of context are folded (head and tail shown; click to expand); trained tokens
    // and merge marks are always shown
    let t = 0;
    while (t < r.ids.length) {
      let u = t;
      while (u < r.ids.length && r.mask[u] === 0 && (u === t || !marks.has(u))) u++;
      if (u === t) u = t + 1;
      if (r.mask[t] === 0 && u - t > FOLD_AT) {
        emit(frag, t, t + FOLD_HEAD);
        const a = t + FOLD_HEAD, b = u - FOLD_TAIL;
        const fold = el("span", { class: "fold", text: " … " + (b - a) + " context tokens (show) … " });
        fold.addEventListener("click", () => { const f = document.createDocumentFragment(); emit(f, a, b); fold.replaceWith(f); });
        frag.append(fold);
        emit(frag, b, u);
      } else emit(frag, t, u);
      t = u;
    }
    toks.append(frag); box.append(toks);
    return box;
  }

  document.getElementById("facts").textContent = DATA.run_dir + " · model " + DATA.model + " · harness " + DATA.harness + " · " + DATA.rollouts.length + " rollouts, " + DATA.metrics.length + " steps" + (DATA.bad_lines ? " · " + DATA.bad_lines + " unreadable lines skipped" : "");
  renderCurves(); renderFilters(); renderList();
})();
