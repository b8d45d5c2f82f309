"""The run's report: one self-contained HTML page with its PNG charts beside it.

``inputs`` reads what the stages left (GPU reset logs, the extraction's manifest, the training's
metrics and charts, the evaluation), forgiving of what is missing; ``render`` turns those records
into escaped HTML; ``figures`` copies the training charts and draws the acceptance chart;
``build`` writes the report directory atomically and only when its inputs changed; ``command``
is ``eagle3-pipeline report``.
"""
