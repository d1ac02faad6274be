"""`replay report`: one self-contained HTML file that shows a run and, when there is one, a comparison:
`run_facts` (one pass over the capture) -> `comparison` (a replay's or a second run's divergences, binned by
`bins`; `pairs` compares two runs position by position) -> `sections` and `page` (the document; assets/report.js draws
its plots) -> `build` (`write_report`)."""

from replay.report.build import (
    KEEP_DIVERGENCES,
    ReportResult,
    default_output,
    write_report,
)

__all__ = ["KEEP_DIVERGENCES", "ReportResult", "default_output", "write_report"]
