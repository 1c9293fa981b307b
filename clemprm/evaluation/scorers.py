"""The one way an eval mode gets its scorer (:class:`clemprm.play.contract.Scorer`): :data:`SCORERS`, from the
scorer a mode's row of :data:`clemprm.modes.MODES` names to what makes it.

``random`` and ``rule`` are the controls that score with no model (:data:`MODEL_FREE_SCORERS`: no PRM pairs
counted, no counters reported); ``logprob`` ranks by the mode's own policy; ``prm`` is the trained PRM of either kind
(:func:`clemprm.models.prm.load_prm`), which must read what the mode's regime shows it; ``implicit`` is PRIME's
implicit PRM (:mod:`clemprm.evaluation.implicit_scorer`). The model-backed ones import torch when made.
"""

from __future__ import annotations

from clemprm.models.logprob import LogprobScorer
from clemprm.modes import EvalMode
from clemprm.play.contract import Scorer
from clemprm.search import RandomScorer, RuleScorer

MODEL_FREE_SCORERS = ("random", "rule")   # controls that score with no model


def make_random(mode: EvalMode, settings: dict, inputs: dict, policy, cache_dir: str | None):
    return RandomScorer(settings["seed"]), None


def make_rule(mode: EvalMode, settings: dict, inputs: dict, policy, cache_dir: str | None):
    return RuleScorer(), None


def make_logprob(mode: EvalMode, settings: dict, inputs: dict, policy, cache_dir: str | None):
    return LogprobScorer(policy), None


def make_prm(mode: EvalMode, settings: dict, inputs: dict, policy, cache_dir: str | None):
    """The trained PRM of the mode's ``prm_adapter``; refused when it was trained on another input than the mode's
    regime shows (:attr:`clemprm.modes.EvalMode.prm_input`)."""
    from clemprm.models.prm import load_prm

    adapter = mode.required_input(inputs, "prm_adapter")
    if settings["prm"]["input"] != mode.prm_input:
        raise ValueError(f"eval mode {mode.name} ({mode.regime}) needs a PRM trained on '{mode.prm_input}', but "
                         f"prm.input is '{settings['prm']['input']}'")
    return load_prm(settings["model"], settings["prm"], adapter, cache_dir), adapter


def make_implicit(mode: EvalMode, settings: dict, inputs: dict, policy, cache_dir: str | None):
    """PRIME's implicit PRM, the ``prm/`` folder of the mode's ``rl_adapter``, against the SFT adapter."""
    from clemprm.evaluation.implicit_scorer import load_implicit_prm

    rl_adapter = mode.required_input(inputs, "rl_adapter")
    scorer = load_implicit_prm(settings["model"], rl_adapter, mode.required_input(inputs, "sft_adapter"),
                               settings["rl"]["prime"]["beta"], cache_dir)
    return scorer, f"{rl_adapter}/prm"


# a mode's scorer name -> (mode, settings, inputs, policy, cache_dir) -> (the scorer, the adapter it was loaded from)
SCORERS = {"random": make_random, "rule": make_rule, "logprob": make_logprob, "prm": make_prm,
           "implicit": make_implicit}


def load_scorer(mode: EvalMode, settings: dict, inputs: dict, policy, cache_dir: str | None,
                given: Scorer | None = None) -> tuple[Scorer | None, str | None]:
    """``(scorer, its adapter)`` ranking ``mode``'s candidates (None, None for greedy play). ``given`` replaces a
    scorer that a model backs (tests; the model-free controls are always made here), with the ``prm_adapter``
    input as its adapter."""
    if mode.scorer is None:
        return None, None
    if given is not None and mode.scorer not in MODEL_FREE_SCORERS:
        return given, inputs.get("prm_adapter")
    return SCORERS[mode.scorer](mode, settings, inputs, policy, cache_dir)
