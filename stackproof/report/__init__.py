"""Report: the run record (record.py: Report, Check, the schema) and its renderings: report.json, junit.xml and the
terminal table (record.py), stackproof.prom (metrics.py), the HTML page (page.py, fleet.py, plots.py: these need
the extra stackproof[report]). Nothing here judges; it says what the judge and the run recorded."""
