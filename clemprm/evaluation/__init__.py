"""Evaluation and report: playing the eval modes, their summary with confidence intervals, figures, inspection.

* :mod:`clemprm.evaluation.evaluate`: one eval mode's episodes (greedy, the searches) and the summary of all modes
  into ``results/prm_eval.json`` (schema: ``prm_eval.schema.json`` here).
* :mod:`clemprm.evaluation.self_correct`: eval mode ``self_correct`` (SCoRe's two attempts, SFT and SCoRe policy)
  and its ``self_correction`` summary.
* :mod:`clemprm.evaluation.scorers`: :func:`~clemprm.evaluation.scorers.load_scorer`, the one factory of every
  mode's scorer; :mod:`clemprm.evaluation.implicit_scorer`: PRIME's implicit PRM as a scorer.
* :mod:`clemprm.evaluation.report`: the figures of the Snakemake report.
* :mod:`clemprm.evaluation.transcript`: episode transcripts and a search's choices as HTML pages of the report.
* :mod:`clemprm.evaluation.inspect`: ``clemprm inspect``, a summary of any record file.
* :mod:`clemprm.evaluation.console`: ``clemprm summary``, the results table printed at the end of a run (with a
  warning when the table is stale or another run's, and the failed jobs' own errors).
* :mod:`clemprm.evaluation.seeds`: the learning benchmark's table over seeds and the claims judged on it.
"""
