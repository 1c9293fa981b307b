"""Online RL of the policy on games: GRPO and PRIME on one trainer, rollouts through the one rollout engine.

* :mod:`clemprm.rl.rollouts`: groups of ``G`` episodes per train instance, played in lockstep by the current
  policy; every answer keeps its tokens; a *sequence* is one player's turns of one episode (self-play: one per
  player).
* :mod:`clemprm.rl.rewards`: the outcome reward of an episode (success + played, or BENCH_SCORE / 100).
* :mod:`clemprm.rl.logprobs`: per-token log-probabilities of played answers with an adapter on or all off
  (selective log-softmax, answer positions only, no cache).
* objectives, each setting per-token advantages on the turns: :mod:`clemprm.rl.grpo` (outcome advantage) and
  :mod:`clemprm.rl.prime` (+ process advantages of an implicit PRM, a second adapter trained online).
* :mod:`clemprm.rl.trainer`: the step (rollouts, advantages, per-turn backward, clipping, optimizer) and the
  ``rl_adapter`` stage; :mod:`clemprm.rl.policy_adapter`: the adapters it trains on the base, their optimizer and
  schedule; :mod:`clemprm.rl.policy_update`: the per-turn loss and backward, and the update's statistics.

Why not TRL's ``GRPOTrainer``: its ``rollout_func`` returns one completion (one scalar advantage) per prompt
sample. A game episode here is several turns, in self-play two sequences (one per player), PRIME needs per-token
advantages and a second adapter updated online inside the step, SCoRe two linked attempts with a KL on one and a
policy gradient on the other, and the per-turn backward needs the turns as units. Each would be a workaround
around its loop; its remaining parts (generation, which the engine does, and a loss of a few lines) are what
this trainer keeps small. So: one trainer of our own on PEFT + torch, with TRL's conventions where they apply
(K3 KL with the adapter-disabled reference, beta 0 by default, the ratio form of the on-policy loss).
"""
