"""Evaluation and report: playing the eval modes, their summary with confidence intervals, figures, inspection.

* :mod:`clemprm.evaluation.evaluate`: one eval mode's episodes (greedy, the searches) and the summary of all modes
  into ``results/prm_eval.json`` (schema: ``prm_eval.schema.json`` here).
* :mod:`clemprm.evaluation.report`: the figures of the Snakemake report.
* :mod:`clemprm.evaluation.transcript`: episode transcripts and a search's choices as HTML pages of the report.
* :mod:`clemprm.evaluation.inspect`: ``clemprm inspect``, a summary of any record file.
"""
