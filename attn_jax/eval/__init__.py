"""Evaluation: `tasks` (benchmark loaders), `harness` (log-likelihood scoring as
lm-evaluation-harness does it, metrics, `evaluate`), `report` (JSON/Markdown tables),
`niah` (needle in a haystack grid), `mqar` (associative-recall accuracy), `stream_reports`
(the files, means, tables and figures of streaming scores, `streaming.py`)."""
