// In <head>, before any content: a blocked load or an error in the body is dispatched while the body is parsed, before
// the main script (at its end) exists, and a listener added then would miss it. What fails before #errors is parsed
// waits in `queued`; the main script shows it first thing (fail.flush), and DOMContentLoaded does if that never ran.
(function () {
  "use strict";
  var queued = [];
  function show(msg) {
    var box = document.getElementById("errors");
    if (!box || !document.body) {
      queued.push(msg);
      return;
    }
    box.hidden = false;
    box.textContent += msg + "\n";
    document.body.setAttribute("data-status", "error");
  }
  function fail(msg) {
    fail.flush();
    show(msg);
  }
  fail.flush = function () {
    var q = queued;
    queued = [];
    q.forEach(show);
  };
  window.addEventListener("error", function (e) {
    fail("script error: " + e.message + " (line " + e.lineno + ")");
  });
  document.addEventListener("securitypolicyviolation", function (e) {
    fail("blocked by the page's policy: " + e.blockedURI);
  });
  document.addEventListener("DOMContentLoaded", fail.flush);
  window.replayFail = fail;
})();
