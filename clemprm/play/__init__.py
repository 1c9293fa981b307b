"""Playing games in-process: the one rollout engine and what it needs from clemcore.

* :mod:`clemprm.play.engine`: :class:`~clemprm.play.engine.RolloutEngine` plays many episodes in lockstep (one
  batched ``generate`` call per step for all of them); base rollouts, branch points, labels, RL and the searches
  all play through it.
* :mod:`clemprm.play.episode`: :class:`~clemprm.play.episode.Episode`, one game being played: fork, its own random
  generators, the game's scores and its record row.
* :mod:`clemprm.play.contract`: what the engine asks of a model (``Sampling``) and what one answer holds
  (``Generation``); the models import it, not the engine.
* :mod:`clemprm.play.catalog`: finds a game (built-in or in a clembench checkout) and its instances, by split.
* :mod:`clemprm.play.clemcore_setup`: clemcore glue, including the narrow adapters for games written against older
  clemcore APIs.
* :mod:`clemprm.play.chat`: messages as a clemcore backend sends them and the one prompt renderer.
* :mod:`clemprm.play.clembench_tree`: played episodes as a clembench results tree (clemcore's layout), which
  ``clem score``, ``clem transcribe`` and ``clem eval`` read.

The project's own games live next door in :mod:`clemprm.games`.
"""
