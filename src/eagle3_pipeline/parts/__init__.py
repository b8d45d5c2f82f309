"""A job over a dataset's records, split into parts per host: the layer below the extraction and the regeneration.

``files.py``: what a part keeps on disk (its name, journal, lock, the directory's settings
claim); ``job.py``: the run (plan, lock, claim, a worker pool over what is left, progress,
exit codes, the command line). A stage gives only what differs: what a worker does with one
record, what a finished part holds and how parts merge.
"""
