"""Models and generation: the one model loader and the batched decoder every stage generates with.

* :mod:`clemprm.models.loader`: model specs (``embedded:``, ``tiny:``, hub ids, local folders), loading with or
  without an adapter, quantisation on CUDA.
* :mod:`clemprm.models.generation`: :class:`~clemprm.models.generation.PolicyModel`, the clemcore model the engine
  plays with: chat rendering, batched sampling with a shared-prefix cache.
* :mod:`clemprm.models.gated_delta`: a CPU kernel for Gated-DeltaNet layers (Qwen3.5) used by generation.
* :mod:`clemprm.models.scoring`: padding, micro-batches and the one shared-prefix forward of the scorers.
* :mod:`clemprm.models.prm`: the PRM as a scorer; :mod:`clemprm.models.logprob`: the policy's log-probability
  scorer.
"""
