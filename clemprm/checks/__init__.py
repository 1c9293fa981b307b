"""Checks that stop a run early, saying why: at parse time (:mod:`clemprm.checks.parse_time`, called by the
Snakefile before any job runs) and at run time (:mod:`clemprm.checks.run_time`, called by the stages)."""
