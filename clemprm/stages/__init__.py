"""The pipeline's training-side stages, one module each, in DAG order; each rule script calls one function here.

* :mod:`clemprm.stages.rollouts`: the play of a split that base rollouts, the eval modes and self-correction all
  go through (:func:`~clemprm.stages.rollouts.play_split`); base-policy rollouts and the win filter.
* :mod:`clemprm.stages.sft`: the SFT LoRA adapter (QLoRA on CUDA) on the wins.
* :mod:`clemprm.stages.branch_points`: branch points from the SFT policy (siblings, held-out states, replayed states);
  :mod:`clemprm.stages.labels`: their K-rollout Monte-Carlo soft labels (shards, checkpoints, the gather), each
  continuation scored by :mod:`clemprm.stages.continuation_scores`.
* :mod:`clemprm.stages.prm`: training the process reward model (a one-logit sequence classifier with LoRA) and its
  predictions, on the examples of :mod:`clemprm.stages.prm_data`; :mod:`clemprm.stages.prm_evaluation`: the
  ``prm_metrics`` rule, the PRM measured with no model, by :mod:`clemprm.stages.prm_metrics` (the metrics of the PRM
  and its baselines, the quality gate);
  :mod:`clemprm.stages.probe`: the probe PRM (``prm.kind: probe``), a head fitted on the policy's hidden states.
* :mod:`clemprm.stages.answers`: every train answer the run played, with the game's verdict on it.
* :mod:`clemprm.stages.merge`: fp32 adapter merges with a verification report.
* :mod:`clemprm.stages.rl_states`: the hanabi prompt set (states of the rule-based player's self-play).

Online RL (GRPO, PRIME) has its own room, :mod:`clemprm.rl`.
"""
