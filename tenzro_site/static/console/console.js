// Coverage heatmap: clicking a cell loads that expert's holders into #holders (one delegated
// listener instead of an htmx attribute on each of up to ~25k cells).
document.addEventListener("click", function (ev) {
  var cell = ev.target.closest ? ev.target.closest("td[data-l]") : null;
  var grid = cell ? cell.closest("table[data-holders-url]") : null;
  if (!grid || !window.htmx) return;
  var url = grid.dataset.holdersUrl + "?layer=" + cell.dataset.l + "&expert=" + cell.dataset.e;
  document.querySelectorAll("td.picked").forEach(function (c) { c.classList.remove("picked"); });
  cell.classList.add("picked");
  window.htmx.ajax("GET", url, {target: "#holders", swap: "innerHTML"});
});
