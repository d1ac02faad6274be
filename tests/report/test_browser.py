"""The reports in a real browser (headless Chromium, the network blocked), as a user opens them from disk: the
script runs to the end with no error and nothing on the console, every plot is drawn, the heat map has one row per
request shown, and the first divergence on the page is the one `replay run --diff --json` reports."""

from __future__ import annotations

import pytest

from replay.report.run_facts import run_facts
from tests.report.chromium import Dom, load, needs_chromium
from tests.report.helpers import page_data

pytestmark = needs_chromium
TIMELINE = ["tl-batch", "tl-tokens", "tl-time", "tl-marks", "tl-axis"]
COMPARISON = ["heatmap", "heatmap-overlay", "scatter"]
_opened: dict[str, Dom] = {}


def _open(made, tmp_path_factory) -> Dom:
    """The page after its script ran, checked for errors and console output (each page opened once)."""
    key = str(made.page)
    if key not in _opened:
        dom, _, console = load(made.page, tmp_path_factory.mktemp("profile"))
        assert console == [], console
        assert dom.status() == "ready", dom.text["errors"]
        assert "hidden" in dom.by_id("errors") and dom.text["errors"] == ""
        _opened[key] = dom
    return _opened[key]


@pytest.mark.parametrize("which,plots", [("run_only", TIMELINE), ("bf16", TIMELINE + COMPARISON),
                                         ("two_runs", TIMELINE + COMPARISON), ("binned", TIMELINE[:2] + COMPARISON)])
def test_every_plot_is_drawn_without_an_error(which, plots, request, tmp_path_factory):
    made = request.getfixturevalue(which)
    dom = _open(made, tmp_path_factory)
    for id_ in plots:
        assert int(dom.by_id(id_).get("data-painted", 0)) > 0, id_
    data = page_data(made.page)
    assert len(dom.inside("tr", "req-body")) == min(200, data["requests"]["n"])  # the table's first page
    if data["comparison"]:
        hm = data["comparison"]["heatmap"]
        assert [r["title"]
                for r in dom.with_class("hm-row")] == hm["row_labels"] and len(hm["row_labels"]) == hm["rows"]
        assert dom.by_id("hm-rows")["data-clipped"] == "0"  # every readable row label is whole


def test_one_heat_map_row_per_request(bf16, recorded, tmp_path_factory):
    dom = _open(bf16, tmp_path_factory)
    assert [r["title"] for r in dom.with_class("hm-row")] == [f.name for f in run_facts(recorded).requests.values()]


def test_the_first_divergence_shown_is_the_one_json_reports(bf16, tmp_path_factory):
    dom = _open(bf16, tmp_path_factory)
    first, flip = bf16.json["first_divergence"], bf16.json["first_token_flip"]
    card = dom.by_id("first-divergence")
    assert (int(card["data-step"]), card["data-request"], int(card["data-position"])) == (
        first["step"], first["request_id"], first["position"])
    assert f"step{first['step']}request{first['request_id']}output position{first['position']}" in \
        dom.text["first-divergence"]
    assert f"step{flip['step']}request{flip['request_id']}output position{flip['position']}" in dom.text["first-flip"]
    assert dom.text["verdict"] == bf16.stdout.splitlines()[1]


def test_the_harness_sees_a_blocked_load_and_a_script_error(bf16, tmp_path):
    """The checks above would catch a page that reaches for the network or throws: plant both in a copy."""
    bad = tmp_path / "bad.html"
    bad.write_text(bf16.page.read_text().replace("<main>", '<main><img src="https://example.com/x.png">', 1)
                   .replace("function timeline() {", "function timeline() { no_such_function();", 1))
    dom, _, console = load(bad, tmp_path / "profile")
    assert dom.status() == "error" and "no_such_function" in dom.text["errors"] and "example.com" in dom.text["errors"]
    assert console  # Chromium logs the blocked load
