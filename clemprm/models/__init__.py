"""Models and generation: the one model loader and the batched decoder every stage generates with.

* :mod:`clemprm.models.loader`: model specs (``embedded:``, ``tiny:``, hub ids, local folders), loading with or
  without an adapter, quantisation on CUDA. The models of two specs are built in code, once, into the model cache
  (:mod:`clemprm.models.materialise`): the tiny test model (:mod:`clemprm.models.tiny`) and the embedded SmolLM2
  (:mod:`clemprm.models.embedded`).
* :mod:`clemprm.models.generation`: :class:`~clemprm.models.generation.PolicyModel`, the clemcore model the engine
  plays with: chat rendering, tokenising, per-item errors, thinking stripped; it decodes with
  :mod:`clemprm.models.decoder` (batched decoding of token ids: prefill, prefix reuse, the decode loop), which uses
  :mod:`clemprm.models.kv_cache` (the preallocated KV cache, row snapshots, the prefix store),
  :mod:`clemprm.models.sampling` (HF's sampling on one uniform per row and step) and
  :mod:`clemprm.models.decode_attention` (one-token attention on CPU without the SDPA kernel).
* :mod:`clemprm.models.gated_delta`: a CPU kernel for Gated-DeltaNet layers (Qwen3.5) used by the decoder.
* :mod:`clemprm.models.scoring`: padding, micro-batches and the one shared-prefix forward of the scorers.
* :mod:`clemprm.models.prm`: the PRM as a scorer, of either kind (a LoRA sequence classifier, or
  :mod:`clemprm.models.probe`: a head on the policy's hidden states); :mod:`clemprm.models.logprob`: the policy's
  log-probability scorer.
* :mod:`clemprm.models.lora_merge`: a LoRA adapter merged into its base weights (tied weights untied first) and
  what the merge did to them; the merge stage's mechanics.
"""
