"""The run's report: one self-contained HTML page with its PNG charts beside it.

``inputs`` reads what the stages left (GPU reset logs, the extraction's manifest, the training's
metrics and charts, the evaluation), forgiving of what is missing; ``checks`` judges them into the
page's verdict (the headline, what passed, what to look at); ``render`` turns those records into
escaped HTML, the verdict first and the settings last, folded; ``figures`` copies the training
charts and draws the acceptance chart; ``build`` writes the report directory atomically and only
when its inputs changed; ``command`` is ``eagle3-pipeline report``.
"""
