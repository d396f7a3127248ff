(function () {
  "use strict";
  var table = document.getElementById("tensors");
  var body = table ? table.tBodies[0] : null;
  var nameBox = document.getElementById("f-name");
  var statusBox = document.getElementById("f-status");
  var unitBox = document.getElementById("f-unit");
  var count = document.getElementById("f-count");
  var rows = body ? Array.prototype.slice.call(body.rows) : [];

  function cellValue(row, col, numeric) {
    var cell = row.cells[col];
    var v = cell.getAttribute("data-v");
    if (numeric) { return v === null || v === "" ? NaN : parseFloat(v); }
    return (v === null ? cell.textContent : v).toLowerCase();
  }

  function sortBy(th) {
    var col = parseInt(th.getAttribute("data-col"), 10);
    var numeric = th.getAttribute("data-type") === "num";
    var descending = th.getAttribute("aria-sort") === "ascending";
    Array.prototype.forEach.call(table.tHead.rows[0].cells, function (other) {
      other.setAttribute("aria-sort", "none");
    });
    th.setAttribute("aria-sort", descending ? "descending" : "ascending");
    var keyed = rows.map(function (row, i) { return [cellValue(row, col, numeric), i, row]; });
    keyed.sort(function (x, y) {
      var a = x[0], b = y[0];
      var missingA = numeric ? isNaN(a) : a === "", missingB = numeric ? isNaN(b) : b === "";
      if (missingA !== missingB) { return missingA ? 1 : -1; }
      if (!missingA && a !== b) { return (a < b ? -1 : 1) * (descending ? -1 : 1); }
      return x[1] - y[1];
    });
    keyed.forEach(function (k) { body.appendChild(k[2]); });
    rows = keyed.map(function (k) { return k[2]; });
  }

  function applyFilter() {
    var text = nameBox.value.trim().toLowerCase();
    var status = statusBox.value, unit = unitBox.value, shown = 0;
    rows.forEach(function (row) {
      var name = row.cells[2].textContent.toLowerCase();
      var rowStatus = row.getAttribute("data-status");
      var ok = (!text || name.indexOf(text) >= 0) &&
        (!status || (status.charAt(0) === "!" ? rowStatus !== status.slice(1) : rowStatus === status)) &&
        (!unit || row.getAttribute("data-unit") === unit);
      row.hidden = !ok;
      if (ok) { shown += 1; }
    });
    count.textContent = shown + " of " + rows.length + " rows";
  }

  function reveal() {
    var id = decodeURIComponent(location.hash.slice(1));
    var row = id ? document.getElementById(id) : null;
    if (!row || row.tagName !== "TR") { return; }
    if (row.hidden) { nameBox.value = ""; statusBox.value = ""; unitBox.value = ""; applyFilter(); }
    row.classList.remove("flash"); void row.offsetWidth; row.classList.add("flash");
    row.scrollIntoView({block: "center"});
  }

  if (table) {
    Array.prototype.forEach.call(table.tHead.rows[0].cells, function (th) {
      th.querySelector("button").addEventListener("click", function () { sortBy(th); });
    });
    nameBox.addEventListener("input", applyFilter);
    statusBox.addEventListener("change", applyFilter);
    unitBox.addEventListener("change", applyFilter);
    window.addEventListener("hashchange", reveal);
    applyFilter();
  }

  Array.prototype.forEach.call(document.querySelectorAll(".swatch"), function (button) {
    button.addEventListener("click", function () {
      var on = button.getAttribute("aria-pressed") !== "true";
      button.setAttribute("aria-pressed", on ? "true" : "false");
      var line = document.querySelector("#curve .line[data-unit='" + button.getAttribute("data-unit") + "']");
      if (line) { line.classList.toggle("off", !on); }
    });
  });

  var heat = document.getElementById("heat-data");
  var svg = document.getElementById("heatmap");
  var tip = document.getElementById("heat-tip");
  if (heat && svg && tip) {
    var meta = JSON.parse(heat.textContent);
    var levels = atob(meta.levels);
    svg.addEventListener("mousemove", function (event) {
      var point = svg.createSVGPoint();
      point.x = event.clientX; point.y = event.clientY;
      var p = point.matrixTransform(svg.getScreenCTM().inverse());
      var col = Math.floor((p.x - meta.left) / meta.cellW), row = Math.floor((p.y - 8) / meta.rowH);
      if (col < 0 || row < 0 || col >= meta.columns || row >= meta.rows.length) { tip.hidden = true; return; }
      var level = levels.charCodeAt(row * meta.columns + col), value;
      if (level === 0) { value = "no data"; }
      else if (level === 1) { value = "rel_diff 0"; }
      else if (level === 2) { value = "NaN/Inf"; }
      else {
        var v = Math.pow(10, meta.low + (level - 3) / 252 * (meta.high - meta.low));
        value = "rel_diff \u2248 " + v.toPrecision(2);
      }
      var first = col * meta.bin, where = meta.bin > 1 ? first + "-" + (first + meta.bin - 1) : String(first);
      tip.textContent = meta.rows[row] + "\nposition " + where + ": " + value;
      tip.style.left = (event.clientX + 14) + "px"; tip.style.top = (event.clientY + 10) + "px";
      tip.hidden = false;
    });
    svg.addEventListener("mouseleave", function () { tip.hidden = true; });
  }
  reveal();
})();
