// The report page's script: draws the plots from the JSON the page embeds, and makes the request table sortable and
// filterable. Plain ES2017 with no library, inline in the page, so the file opens offline from file://.
//
// Dense plots (the heat map, the timeline) are <canvas> elements fed at most one value per column of pixels
// (replay/report/bins.py); the heat map is one canvas pixel per cell, scaled up with `image-rendering: pixelated`.
// After drawing, each canvas carries `data-painted` (its non-transparent pixels) and the body `data-status="ready"`;
// an error or a blocked load goes into #errors and sets `data-status="error"`: what the browser tests read. The
// listeners for those are in <head> (watch.js), so they are there before anything in the body can fail.
(function () {
  "use strict";
  var errors = document.getElementById("errors");
  var fail = window.replayFail;
  fail.flush();
  var D = JSON.parse(document.getElementById("report-data").textContent);
  var tip = document.getElementById("tip");
  function $(id) {
    return document.getElementById(id);
  }
  function el(tag, cls, text) {
    var e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  }
  function fmt(x) {
    if (x === null || x === undefined) return "\u2013";
    if (typeof x !== "number") return String(x);
    if (Number.isInteger(x)) return x.toLocaleString("en-US");
    var a = Math.abs(x);
    return a !== 0 && (a < 1e-3 || a >= 1e5) ? x.toExponential(2) : String(+x.toPrecision(3));
  }
  function pow10(e) {
    return "1e" + e;
  }
  function setup(cv) {
    // size a canvas to its CSS box, at the device's resolution
    var r = cv.getBoundingClientRect(),
      dpr = window.devicePixelRatio || 1;
    var w = Math.max(1, Math.round(r.width)),
      h = Math.max(1, Math.round(r.height));
    cv.width = Math.round(w * dpr);
    cv.height = Math.round(h * dpr);
    var ctx = cv.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    return { ctx: ctx, w: w, h: h };
  }
  function painted(cv) {
    var d = cv.getContext("2d").getImageData(0, 0, cv.width, cv.height).data,
      n = 0;
    for (var i = 3; i < d.length; i += 4) if (d[i]) n++;
    cv.setAttribute("data-painted", n);
    return n;
  }
  function showTip(ev, lines) {
    tip.textContent = lines.join("\n");
    tip.hidden = false;
    var x = ev.clientX + 14,
      y = ev.clientY + 14,
      r = tip.getBoundingClientRect();
    if (x + r.width > window.innerWidth) x = ev.clientX - r.width - 10;
    if (y + r.height > window.innerHeight) y = ev.clientY - r.height - 10;
    tip.style.left = x + "px";
    tip.style.top = y + "px";
  }
  function hideTip() {
    tip.hidden = true;
  }
  function hover(cv, lines) {
    cv.addEventListener("mousemove", function (ev) {
      var r = cv.getBoundingClientRect(),
        out = lines((ev.clientX - r.left) / r.width, (ev.clientY - r.top) / r.height);
      if (out) showTip(ev, out);
      else hideTip();
    });
    cv.addEventListener("mouseleave", hideTip);
  }
  // -- the step timeline ----------------------------------------------------------------------------------------
  var S = D.steps;
  function stepRange(c) {
    return S.start[c] === S.end[c] ? "step " + S.start[c] : "steps " + S.start[c] + "\u2013" + S.end[c];
  }
  function stepLines(c) {
    var many = S.start[c] !== S.end[c],
      out = [stepRange(c) + (many ? " (mean, peak)" : "")];
    out.push("requests " + fmt(S.requests_mean[c]) + (many ? ", peak " + fmt(S.requests_max[c]) : ""));
    out.push(
      "tokens: prefill " +
        fmt(S.prefill[c]) +
        ", decode " +
        fmt(S.decode[c]) +
        (many ? ", peak " + fmt(S.tokens_max[c]) : ""),
    );
    if (S.timed)
      out.push(
        "ms: schedule " + fmt(S.schedule[c]) + ", execute " + fmt(S.execute[c]) + ", update " + fmt(S.update[c]),
      );
    if (S.preempted[c]) out.push("preemptions " + fmt(S.preempted[c]));
    if (S.prefix_hits[c]) out.push("prefix-cache hits " + fmt(S.prefix_hits[c]));
    S.crashes.forEach(function (k) {
      if (k[0] === c) out.push("crash at step " + k[1] + ": " + k[2]);
    });
    return out;
  }
  function colOf(fx) {
    return Math.min(S.cols - 1, Math.max(0, Math.floor(fx * S.cols)));
  }
  function panel(id, series, colors, peak) {
    var cv = $(id);
    if (!cv) return;
    var g = setup(cv),
      ctx = g.ctx,
      C = S.cols,
      bw = g.w / C,
      top = 0,
      c,
      k;
    for (c = 0; c < C; c++) top = Math.max(top, peak[c]);
    top = top || 1;
    for (c = 0; c < C; c++) {
      var y = g.h;
      for (k = 0; k < series.length; k++) {
        var v = series[k][c];
        if (!v) continue;
        var hh = (v / top) * (g.h - 2),
          x0 = Math.floor(c * bw),
          x1 = Math.floor((c + 1) * bw);
        ctx.fillStyle = colors[k];
        ctx.fillRect(x0, y - hh, Math.max(bw > 4 ? x1 - x0 - 1 : x1 - x0, 1), Math.max(hh, 0.5));
        y -= hh;
      }
    }
    if (S.n > C) {
      // several steps a column: the bars are means, the line the peak
      ctx.strokeStyle = "rgba(15,23,42,.6)";
      ctx.lineWidth = 1;
      ctx.beginPath();
      for (c = 0; c < C; c++) {
        var py = g.h - (peak[c] / top) * (g.h - 2);
        ctx[c ? "lineTo" : "moveTo"](c * bw, py);
        ctx.lineTo((c + 1) * bw, py);
      }
      ctx.stroke();
    }
    $(id + "-max").textContent = "scale 0\u2013" + fmt(+top.toPrecision(3));
    painted(cv);
    hover(cv, function (fx) {
      return stepLines(colOf(fx));
    });
  }
  function marks() {
    var cv = $("tl-marks"),
      g = setup(cv),
      ctx = g.ctx,
      bw = g.w / S.cols,
      w = Math.max(Math.floor(bw), 1);
    for (var c = 0; c < S.cols; c++) {
      if (S.preempted[c]) {
        ctx.fillStyle = "#dc2626";
        ctx.fillRect(Math.floor(c * bw), 0, w, g.h / 2 - 1);
      }
      if (S.prefix_hits[c]) {
        ctx.fillStyle = "#16a34a";
        ctx.fillRect(Math.floor(c * bw), g.h / 2 + 1, w, g.h / 2 - 1);
      }
    }
    ctx.fillStyle = "#111";
    S.crashes.forEach(function (k) {
      ctx.fillRect(k[0] * bw, 0, Math.max(bw, 2), g.h);
    });
    painted(cv);
    hover(cv, function (fx) {
      return stepLines(colOf(fx));
    });
  }
  function axis(id) {
    var cv = $(id);
    if (!cv) return;
    var g = setup(cv),
      ctx = g.ctx,
      ticks = Math.min(S.cols, Math.max(2, Math.floor(g.w / 110)));
    ctx.fillStyle = "#475569";
    ctx.font = "11px system-ui, sans-serif";
    ctx.textBaseline = "top";
    for (var i = 0; i < ticks; i++) {
      var c = Math.round((i * (S.cols - 1)) / Math.max(ticks - 1, 1)),
        x = ((c + 0.5) * g.w) / S.cols;
      ctx.fillRect(x, 0, 1, 4);
      ctx.textAlign = i === 0 ? "left" : i === ticks - 1 ? "right" : "center";
      ctx.fillText(String(S.start[c]), x, 6);
    }
    painted(cv);
  }
  function timeline() {
    if (!S || !S.cols) return;
    panel("tl-batch", [S.requests_mean], ["#64748b"], S.requests_max);
    panel("tl-tokens", [S.prefill, S.decode], ["#f59e0b", "#3b82f6"], S.tokens_max);
    if (S.timed) panel("tl-time", [S.schedule, S.execute, S.update], ["#a855f7", "#10b981", "#f97316"], S.time_max);
    marks();
    axis("tl-axis");
  }
  // -- the comparison -------------------------------------------------------------------------------------------
  var STOPS = [
    [252, 253, 191],
    [254, 176, 120],
    [241, 96, 93],
    [183, 55, 121],
    [114, 31, 129],
    [44, 17, 95],
    [0, 0, 4],
  ];
  function ramp(f) {
    var x = Math.min(1, Math.max(0, f)) * (STOPS.length - 1),
      i = Math.min(STOPS.length - 2, Math.floor(x)),
      t = x - i;
    return STOPS[i].map(function (v, j) {
      return Math.round(v + (STOPS[i + 1][j] - v) * t);
    });
  }
  function palette() {
    var lut = [
      [0, 0, 0, 0],
      [125, 185, 222, 255],
      [203, 203, 203, 255],
    ];
    for (var i = 3; i < 256; i++) lut.push(ramp((i - 3) / 251).concat([255]));
    return lut;
  }
  function bytes(b64) {
    var s = atob(b64),
      a = new Uint8Array(s.length);
    for (var i = 0; i < s.length; i++) a[i] = s.charCodeAt(i);
    return a;
  }
  function ring(ctx, x, y, r, cls) {
    ctx.lineWidth = 1.5;
    ctx.beginPath();
    if (cls === 1) {
      ctx.arc(x, y, r, 0, 7);
      ctx.strokeStyle = "#fff";
      ctx.lineWidth = 3.5;
      ctx.stroke();
      ctx.strokeStyle = "#2563eb";
      ctx.lineWidth = 1.8;
      ctx.stroke();
      return;
    }
    if (cls === 2) {
      ctx.moveTo(x, y - r - 1);
      ctx.lineTo(x + r + 1, y);
      ctx.lineTo(x, y + r + 1);
      ctx.lineTo(x - r - 1, y);
      ctx.closePath();
      ctx.strokeStyle = "#fff";
      ctx.lineWidth = 3;
      ctx.stroke();
      ctx.fillStyle = "#e11d48";
      ctx.fill();
      return;
    }
    if (cls === 4) {
      ctx.rect(x - r, y - r, 2 * r, 2 * r);
      ctx.strokeStyle = "#fff";
      ctx.lineWidth = 3.5;
      ctx.stroke();
      ctx.strokeStyle = "#7c3aed";
      ctx.lineWidth = 1.8;
      ctx.stroke();
      return;
    }
    ctx.moveTo(x - r, y - r);
    ctx.lineTo(x + r, y + r);
    ctx.moveTo(x + r, y - r);
    ctx.lineTo(x - r, y + r);
    ctx.strokeStyle = "#111";
    ctx.stroke();
  }
  function crosshair(ctx, g, x, y, color, dash, text, below, avoid) {
    ctx.save();
    ctx.strokeStyle = color;
    ctx.lineWidth = 1.2;
    ctx.setLineDash(dash);
    ctx.beginPath();
    ctx.moveTo(x, 0);
    ctx.lineTo(x, g.h);
    ctx.moveTo(0, y);
    ctx.lineTo(g.w, y);
    ctx.stroke();
    ctx.restore();
    ctx.font = "bold 12px system-ui, sans-serif";
    var tw = ctx.measureText(text).width + 10;
    var lx = Math.min(Math.max(x + 8, 2), g.w - tw - 2),
      ly = below ? Math.min(y + 8, g.h - 20) : Math.max(y - 26, 2);
    if (avoid && lx < avoid[0] + avoid[2] && avoid[0] < lx + tw && Math.abs(ly - avoid[1]) < 20)
      ly = avoid[1] + (ly >= avoid[1] && avoid[1] + 42 <= g.h ? 22 : -22);
    ctx.fillStyle = "rgba(255,255,255,.92)";
    ctx.fillRect(lx, ly, tw, 18);
    ctx.strokeStyle = color;
    ctx.strokeRect(lx, ly, tw, 18);
    ctx.fillStyle = color;
    ctx.textBaseline = "middle";
    ctx.fillText(text, lx + 5, ly + 9);
    return [lx, ly, tw];
  }
  function shrink(cells, rows, cols, w, h) {
    // cells onto at most w x h pixels, keeping each pixel's largest code
    if (cols <= w && rows <= h) return { cells: cells, rows: rows, cols: cols };
    var W = Math.min(cols, w),
      R = Math.min(rows, h),
      out = new Uint8Array(W * R);
    for (var r = 0; r < rows; r++) {
      var o = Math.floor((r * R) / rows) * W;
      for (var c = 0; c < cols; c++) {
        var k = o + Math.floor((c * W) / cols),
          v = cells[r * cols + c];
        if (v > out[k]) out[k] = v;
      }
    }
    return { cells: out, rows: R, cols: W };
  }
  function heatmap() {
    var H = D.comparison.heatmap,
      cv = $("heatmap"),
      ov = $("heatmap-overlay"),
      plot = $("hm-plot");
    var height = Math.max(80, Math.min(H.rows * 14, 560));
    plot.style.height = height + "px";
    var cells = bytes(H.cells),
      dpr = window.devicePixelRatio || 1,
      box = plot.getBoundingClientRect();
    var shown = shrink(
      cells,
      H.rows,
      H.cols,
      Math.max(1, Math.floor(box.width * dpr)),
      Math.max(1, Math.floor(height * dpr)),
    );
    cv.width = shown.cols;
    cv.height = shown.rows; // no more cells than pixels: none is dropped by the scaling
    var ctx = cv.getContext("2d"),
      img = ctx.createImageData(shown.cols, shown.rows),
      px = img.data,
      lut = palette();
    for (var i = 0; i < shown.cells.length; i++) {
      var c = lut[shown.cells[i]];
      px[4 * i] = c[0];
      px[4 * i + 1] = c[1];
      px[4 * i + 2] = c[2];
      px[4 * i + 3] = c[3];
    }
    ctx.putImageData(img, 0, 0);
    painted(cv);
    var rows = $("hm-rows"),
      rh = height / H.rows;
    H.row_labels.forEach(function (name, r) {
      var d = el("div", "hm-row" + (rh < 9 ? " tiny" : ""), name);
      d.style.height = rh + "px";
      d.title = name;
      d.setAttribute("data-row", r);
      rows.appendChild(d);
    });
    // how many readable labels do not fit (the label column grows to the longest: none should)
    rows.setAttribute(
      "data-clipped",
      Array.prototype.filter.call(rows.children, function (d) {
        return !/tiny/.test(d.className) && d.scrollWidth > d.clientWidth + 1;
      }).length,
    );
    var g = setup(ov),
      o = g.ctx,
      cw = g.w / H.cols,
      ch = g.h / H.rows,
      r0 = Math.max(2, Math.min(5, Math.min(cw, ch) * 0.4));
    var at = {};
    H.markers.forEach(function (m) {
      at[m[0] * H.rows + m[1]] = Math.max(at[m[0] * H.rows + m[1]] || 0, m[2]);
      ring(o, (m[0] + 0.5) * cw, (m[1] + 0.5) * ch, r0, m[2]);
    });
    var C = D.comparison;
    var same =
      C.first_cell &&
      C.first_flip_cell &&
      C.first_cell[0] === C.first_flip_cell[0] &&
      C.first_cell[1] === C.first_flip_cell[1];
    var box1 = null;
    if (C.first_cell)
      box1 = crosshair(
        o,
        g,
        (C.first_cell[0] + 0.5) * cw,
        (C.first_cell[1] + 0.5) * ch,
        "#111827",
        [6, 3],
        C.first_label + (same ? " (a token flip)" : ""),
        false,
      );
    if (C.first_flip_cell && !same)
      crosshair(
        o,
        g,
        (C.first_flip_cell[0] + 0.5) * cw,
        (C.first_flip_cell[1] + 0.5) * ch,
        "#1d4ed8",
        [2, 3],
        C.first_flip_label,
        true,
        box1,
      );
    painted(ov);
    var names = ["not scheduled", C.equal_label, "not compared (after a token flip)"],
      flipName = ["", "tie flip", "confident flip", "no matching output", "random draw"];
    hover(ov, function (fx, fy) {
      var c = Math.min(H.cols - 1, Math.floor(fx * H.cols)),
        r = Math.min(H.rows - 1, Math.floor(fy * H.rows)),
        v = cells[r * H.cols + c];
      var out = [stepRange(c), H.row_labels[r]];
      out.push(
        v < 3
          ? names[v]
          : v === 3 && H.atol
            ? "max |\u0394logprob| \u2264 atol " + fmt(H.atol)
            : "max |\u0394logprob| \u2248 " + fmt(Math.pow(10, H.lo + ((v - 3) / 251) * (H.hi - H.lo))),
      );
      if (at[c * H.rows + r]) out.push(flipName[at[c * H.rows + r]]);
      return out;
    });
  }
  function scatter() {
    var P = D.comparison.scatter,
      cv = $("scatter"),
      g = setup(cv),
      ctx = g.ctx,
      L = 56,
      B = 34,
      T = 8,
      R = 10;
    var W = g.w - L - R,
      Hh = g.h - T - B;
    function X(lx) {
      return L + ((lx - P.x0) / (P.x1 - P.x0)) * W;
    }
    function Y(ly) {
      return T + Hh - ((ly - P.y0) / (P.y1 - P.y0)) * Hh;
    }
    ctx.font = "11px system-ui, sans-serif";
    ctx.fillStyle = "#475569";
    ctx.strokeStyle = "#e2e8f0";
    ctx.lineWidth = 1;
    for (var e = P.x0; e <= P.x1; e++) {
      ctx.beginPath();
      ctx.moveTo(X(e), T);
      ctx.lineTo(X(e), T + Hh);
      ctx.stroke();
      ctx.textAlign = "center";
      ctx.textBaseline = "top";
      ctx.fillText(pow10(e), X(e), T + Hh + 4);
    }
    for (e = P.y0; e <= P.y1; e++) {
      ctx.beginPath();
      ctx.moveTo(L, Y(e));
      ctx.lineTo(L + W, Y(e));
      ctx.stroke();
      ctx.textAlign = "right";
      ctx.textBaseline = "middle";
      ctx.fillText(pow10(e), L - 5, Y(e));
    }
    ctx.textAlign = "center";
    ctx.textBaseline = "bottom";
    ctx.fillText("max |\u0394logprob| at the position", L + W / 2, g.h);
    ctx.save();
    ctx.translate(12, T + Hh / 2);
    ctx.rotate(-Math.PI / 2);
    ctx.textBaseline = "middle";
    ctx.fillText("top1\u2013top2 margin (nats)", 0, 0);
    ctx.restore();
    ctx.save();
    ctx.beginPath();
    ctx.rect(L, T, W, Hh);
    ctx.clip();
    ctx.setLineDash([5, 4]);
    ctx.strokeStyle = "#2563eb";
    if (P.tie_margin > 0) {
      var ty = Y(Math.log10(P.tie_margin));
      ctx.beginPath();
      ctx.moveTo(L, ty);
      ctx.lineTo(L + W, ty);
      ctx.stroke();
      ctx.fillStyle = "#2563eb";
      ctx.textAlign = "left";
      ctx.textBaseline = "bottom";
      ctx.fillText("tie margin " + P.tie_margin, L + 4, ty - 2);
    }
    ctx.strokeStyle = "#94a3b8";
    ctx.beginPath();
    ctx.moveTo(X(P.x0), Y(P.x0 + Math.log10(2)));
    ctx.lineTo(X(P.x1), Y(P.x1 + Math.log10(2)));
    ctx.stroke();
    ctx.restore();
    var pts = [];
    P.cells.forEach(function (p) {
      var x = L + ((p[0] + 0.5) / P.w) * W,
        y = T + Hh - ((p[1] + 0.5) / P.h) * Hh;
      pts.push([x, y, p]);
      if (p[2] === 0) {
        ctx.fillStyle = "rgba(71,85,105,.55)";
        ctx.fillRect(x - 1.5, y - 1.5, 3, 3);
      } else ring(ctx, x, y, 3.5, p[2]);
    });
    painted(cv);
    var cls = ["logprobs differ, same token", "tie flip", "confident flip"];
    hover(cv, function (fx, fy) {
      var x = fx * g.w,
        y = fy * g.h,
        best = null,
        bd = 64;
      pts.forEach(function (q) {
        var d = (q[0] - x) * (q[0] - x) + (q[1] - y) * (q[1] - y);
        if (d < bd) {
          bd = d;
          best = q[2];
        }
      });
      if (!best) return null;
      var dx = Math.pow(10, P.x0 + ((best[0] + 0.5) / P.w) * (P.x1 - P.x0)),
        my = Math.pow(10, P.y0 + ((best[1] + 0.5) / P.h) * (P.y1 - P.y0));
      return [
        fmt(best[3]) + " \u00d7 " + cls[best[2]],
        "|\u0394logprob| \u2248 " + fmt(dx),
        "margin \u2248 " + fmt(my),
      ];
    });
  }
  // -- the request table ----------------------------------------------------------------------------------------
  function table() {
    var Q = D.requests,
      cols = Q.columns,
      data = Q.data,
      n = Q.n,
      key = null,
      dir = 1,
      limit = 200,
      view = [];
    var thead = $("req-head"),
      body = $("req-body"),
      count = $("req-count"),
      more = $("req-more");
    var filter = $("req-filter"),
      only = $("req-only"),
      names = data.request.map(function (s) {
        return String(s).toLowerCase();
      });
    var ths = cols.map(function (c) {
      var th = el("th", c[2] === "str" ? "" : "num", c[1]);
      th.setAttribute("data-key", c[0]);
      th.tabIndex = 0;
      th.addEventListener("click", function () {
        dir = key === c[0] ? -dir : 1;
        key = c[0];
        refresh();
      });
      thead.appendChild(th);
      return th;
    });
    function cmp(a, b) {
      var x = data[key][a],
        y = data[key][b];
      if (x === y) return a - b;
      if (x === null) return 1;
      if (y === null) return -1;
      return (x < y ? -1 : 1) * dir;
    }
    function refresh() {
      var text = filter.value.trim().toLowerCase(),
        bad = only && only.checked;
      view = [];
      for (var i = 0; i < n; i++) {
        if (text && names[i].indexOf(text) < 0 && String(data.status ? data.status[i] : "").indexOf(text) < 0) continue;
        if (bad && !(data.divergences[i] > 0)) continue;
        view.push(i);
      }
      if (key) view.sort(cmp);
      ths.forEach(function (th) {
        th.setAttribute(
          "aria-sort",
          th.getAttribute("data-key") === key ? (dir > 0 ? "ascending" : "descending") : "none",
        );
      });
      render();
    }
    function render() {
      body.textContent = "";
      var frag = document.createDocumentFragment();
      view.slice(0, limit).forEach(function (i) {
        var tr = el("tr");
        tr.setAttribute("data-request", data.request[i]);
        if (data.divergences && data.divergences[i] > 0) tr.className = data.flips[i] > 0 ? "flipped" : "diverged";
        cols.forEach(function (c) {
          tr.appendChild(el("td", c[2] === "str" ? "" : "num", fmt(data[c[0]][i])));
        });
        frag.appendChild(tr);
      });
      body.appendChild(frag);
      count.textContent =
        "showing " +
        fmt(Math.min(limit, view.length)) +
        " of " +
        fmt(view.length) +
        (view.length < n ? " (" + fmt(n) + " in all)" : "");
      more.hidden = view.length <= limit;
    }
    filter.addEventListener("input", function () {
      limit = 200;
      refresh();
    });
    if (only)
      only.addEventListener("change", function () {
        limit = 200;
        refresh();
      });
    more.addEventListener("click", function () {
      limit += 1000;
      render();
    });
    refresh();
  }
  try {
    timeline();
    if (D.comparison) {
      heatmap();
      scatter();
    }
    table();
    if (errors.hidden) document.body.setAttribute("data-status", "ready");
  } catch (e) {
    fail("script error: " + ((e && e.stack) || e));
  }
})();
