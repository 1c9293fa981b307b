"""The evaluation modes, one row each: which policy plays, how candidates are chosen, what ranks them, the config keys
it plays by and the files it needs.

Each mode plays in one regime (:mod:`clemprm.search`): ``blind`` (one answer per turn reaches the game, as clembench
scores a player; the default and the only figures comparable with clembench) or ``lookahead`` (candidates played in
forks of the game, whose answers the scorer may read; its figures are compared only with lookahead controls).

Everything else reads this table: config validation (the allowed ``eval.modes`` and their cross-key checks), the
rule params (:func:`clemprm.config.eval_mode_params`), the one ``eval_mode`` rule and its inputs (``rules/eval.smk``),
the summary's schema and its baselines, and the evaluation itself (:mod:`clemprm.evaluation.evaluate`). Adding a mode
is one row here (plus its scorer or search, if it brings a new one).
"""

from __future__ import annotations

from dataclasses import dataclass, field

RL_ALGORITHMS = ("grpo", "prime")   # trained side by side by the RL stage (rl.algorithms); each gives a greedy mode

# the eval keys a mode plays by: a mode's rule params hold only these (changing eval.beam_width reruns beam search
# alone, eval.bootstrap_samples only the summary)
PLAY_KEYS = ("split", "max_instances", "episodes_per_instance", "max_new_tokens")
SAMPLING_KEYS = ("n", "temperature", "top_p")
BEAM_KEYS = ("beam_width", "num_beam_iterations", "aggregation")

# what a PRM reads (prm.input) -> the regime of the searches that can show it that: a blind search shows the candidate
# alone; a lookahead search has played it in a fork and can show the game's reply too
PRM_INPUT_REGIMES = {"candidate": "blind", "candidate_with_reply": "lookahead"}
# what kind of PRM a run trains (prm.kind), the default first: the card's LoRA sequence classifier, or a probe on the
# policy's hidden states
PRM_KINDS = ("lora", "probe")

SFT_ADAPTER = "results/sft/adapter"
PRM_ADAPTER = "results/prm/adapter"


def rl_adapter(algorithm: str) -> str:
    return f"results/rl/{algorithm}/adapter"


@dataclass(frozen=True)
class EvalMode:
    """One evaluation mode. ``policy``: ``base``, ``sft``, ``merged`` (the merged SFT checkpoint), ``rl`` (the RL
    adapter of ``algorithm``) or ``sft+score`` (self-correction plays both); ``search``: ``greedy``, ``best_of_n``,
    ``beam_search`` or ``self_correct`` (two attempts); ``scorer``: what ranks a search's candidates (``prm``,
    ``random``, ``logprob`` for the policy's own mean token log-probability, ``implicit`` for PRIME's implicit PRM);
    ``keys``: the eval keys it plays by; ``sections``: further config sections in its params; ``inputs``: the files it
    reads, by the name the evaluation takes them under; ``algorithm``: the RL algorithm it needs trained;
    ``baseline``: the summary reports the difference of every other mode of its regime to it; ``regime``: ``blind``
    or ``lookahead`` (the values of :data:`PRM_INPUT_REGIMES`)."""

    name: str
    policy: str
    search: str = "greedy"
    scorer: str | None = None
    keys: tuple[str, ...] = PLAY_KEYS
    sections: tuple[str, ...] = ()
    inputs: dict[str, str] = field(default_factory=dict)
    algorithm: str | None = None
    baseline: bool = False
    regime: str = "blind"
    description: str = ""

    @property
    def prm_input(self) -> str | None:
        """The input the mode's PRM must have been trained on (``prm.input``): a blind search shows it the candidate
        alone, a lookahead one the candidate with the game's reply; None for a mode without a PRM."""
        if self.scorer != "prm":
            return None
        return next(name for name, regime in PRM_INPUT_REGIMES.items() if regime == self.regime)

    def required_input(self, inputs: dict, name: str) -> str:
        """The file ``inputs`` gives the mode under ``name`` (one of its :attr:`inputs`); a ``ValueError`` naming it
        when none is given."""
        if not inputs.get(name):
            raise ValueError(f"eval mode {self.name} needs its {name} ({self.inputs[name]}): give it")
        return str(inputs[name])

    @property
    def samples(self) -> bool:
        """Whether it samples its candidates (the searches) rather than decoding greedily."""
        return "temperature" in self.keys


SEARCH_KEYS = PLAY_KEYS + SAMPLING_KEYS
MODES: dict[str, EvalMode] = {mode.name: mode for mode in [
    EvalMode("greedy_base", "base", baseline=True, description="the base policy, temperature 0"),
    EvalMode("greedy_sft", "sft", inputs={"sft_adapter": SFT_ADAPTER}, baseline=True,
             description="the SFT policy, temperature 0"),
    *[EvalMode(f"greedy_rl_{algorithm}", "rl", inputs={"rl_adapter": rl_adapter(algorithm)}, algorithm=algorithm,
               baseline=algorithm == "grpo", description=f"the {algorithm} RL policy, temperature 0")
      for algorithm in RL_ALGORITHMS],
    EvalMode("greedy_merged", "merged", inputs={"merged_model": "results/merged/sft"},
             description="the merged SFT checkpoint, temperature 0 (in fp32 on CPU it plays greedy_sft's episodes)"),
    # blind: the game sees one answer per turn, the chosen one
    EvalMode("random_of_n", "sft", "best_of_n", "random", SEARCH_KEYS, inputs={"sft_adapter": SFT_ADAPTER},
             baseline=True, description="best_of_n's N candidates per turn, one played at random: the control"),
    EvalMode("best_of_n", "sft", "best_of_n", "prm", SEARCH_KEYS, ("prm",),
             {"sft_adapter": SFT_ADAPTER, "prm_adapter": PRM_ADAPTER},
             description="N sampled candidates per turn, the PRM's favourite (on the candidate alone) played"),
    EvalMode("best_of_n_logprob", "sft", "best_of_n", "logprob", SEARCH_KEYS, inputs={"sft_adapter": SFT_ADAPTER},
             baseline=True, description="best_of_n ranked by the policy's mean token log-probability"),
    EvalMode("best_of_n_implicit", "sft", "best_of_n", "implicit", SEARCH_KEYS, ("rl",),
             {"sft_adapter": SFT_ADAPTER, "rl_adapter": rl_adapter("prime")}, algorithm="prime",
             description="best_of_n ranked by PRIME's implicit PRM"),
    # lookahead: every candidate is played in a fork and the scorer may read the game's answer to it
    EvalMode("best_of_n_lookahead", "sft", "best_of_n", "prm", SEARCH_KEYS, ("prm",),
             {"sft_adapter": SFT_ADAPTER, "prm_adapter": PRM_ADAPTER}, regime="lookahead",
             description="N candidates per turn played in forks, the PRM's favourite (reading the game's reply) "
                         "goes on"),
    EvalMode("best_of_n_rule", "sft", "best_of_n", "rule", SEARCH_KEYS, inputs={"sft_adapter": SFT_ADAPTER},
             baseline=True, regime="lookahead",
             description="best_of_n_lookahead ranked by a rule with no model reading the fork: the control"),
    EvalMode("beam_search", "sft", "beam_search", "prm", SEARCH_KEYS + BEAM_KEYS, ("prm",),
             {"sft_adapter": SFT_ADAPTER, "prm_adapter": PRM_ADAPTER}, regime="lookahead",
             description="beams of forked games ranked by the PRM (reading the game's reply)"),
    EvalMode("beam_search_rule", "sft", "beam_search", "rule", SEARCH_KEYS + BEAM_KEYS,
             inputs={"sft_adapter": SFT_ADAPTER}, baseline=True, regime="lookahead",
             description="beam_search ranked by a rule with no model reading the fork: the control"),
    EvalMode("beam_search_logprob", "sft", "beam_search", "logprob", SEARCH_KEYS + BEAM_KEYS,
             inputs={"sft_adapter": SFT_ADAPTER}, baseline=True, regime="lookahead",
             description="beam_search ranked by the policy's mean token log-probability"),
    EvalMode("self_correct", "sft+score", "self_correct", sections=("score",),
             inputs={"sft_adapter": SFT_ADAPTER, "score_adapter": "results/score/adapter"},
             description="SCoRe's two greedy attempts per instance, SFT and SCoRe policy (attempt 2 is an episode "
                         "of its own that starts from attempt 1's transcript and verdict; summarized apart)"),
]}

SELF_CORRECT = "self_correct"   # summarized apart (attempt pairs of two policies), as prm_eval.json's self_correction


def prm_input_problem(modes, prm_input: str) -> str | None:
    """A mode of ``modes`` whose PRM must read another input than the one the PRM is trained on (``prm.input``):
    the PRM is trained for one input, a blind search shows it the candidate alone and a lookahead search the
    candidate with the game's reply. None when every mode fits."""
    for name in modes:
        needed = MODES[name].prm_input
        if needed is not None and needed != prm_input:
            return (f"config key 'prm.input': eval mode {name} ({MODES[name].regime}) needs a PRM trained on "
                    f"'{needed}', but prm.input is '{prm_input}' (the PRM is trained for one input): set prm.input: "
                    f"{needed} or drop {name} from eval.modes")
    return None


def upstream_outputs(modes) -> list[str]:
    """The outputs of the earlier stages the given modes are built from, in pipeline order, whose failure marks
    (``on_failure: continue``) the summary carries: every mode but ``greedy_base`` plays a policy trained from the base
    rollouts; the PRM modes also rank by a PRM trained on the soft labels; the RL modes need their RL stage."""
    chosen = [MODES[name] for name in modes]
    outputs = []
    if any(mode.policy != "base" for mode in chosen):
        outputs += ["results/rollouts/base_train.parquet", "results/sft/metrics.json"]
    if any(mode.scorer == "prm" for mode in chosen):
        outputs += ["results/labels/branch_points.parquet", "results/labels/soft_labels.parquet"]
    algorithms = sorted({mode.algorithm for mode in chosen if mode.algorithm})
    return outputs + [f"results/rl/{algorithm}/metrics.json" for algorithm in algorithms]


def probability_search(eval_settings: dict) -> bool:
    """Whether a configured search reads the PRM's values as probabilities: ``beam_search`` (ranked by the PRM) with
    ``eval.aggregation: prod`` multiplies its steps' values, so a PRM off the labels' mean misranks beams. Every other
    search reads only the PRM's order (the argmax among one state's siblings, a beam's last or worst value), which an
    offset does not change. The PRM's quality gate judges calibration only where this holds."""
    return eval_settings["aggregation"] == "prod" and any(
        MODES[name].search == "beam_search" and MODES[name].scorer == "prm" for name in eval_settings["modes"])
