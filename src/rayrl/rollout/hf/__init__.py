"""The HF rollout engine: any transformers causal LM.

- :mod:`~rayrl.rollout.hf.engine`: `HFRolloutEngine` (the engine, its weights and memory).
- :mod:`~rayrl.rollout.hf.requests`: its request-level core (samples in one growing KV
  cache, holes for the rows with nothing to feed).
- :mod:`~rayrl.rollout.hf.decode`: the lean decode loop for models that cannot serve
  requests (``generate()``'s tokens with less overhead).
"""
