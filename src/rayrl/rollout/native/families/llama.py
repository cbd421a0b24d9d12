"""Llama (1 to 3.3, and the many models of its shape): the base layer of `Family`.

Pre-norm RMSNorm, rotary attention with grouped KV heads (any rope scaling transformers
computes once: default, linear, llama3, yarn, ...; not dynamic), biases on q/k/v/o with
``attention_bias``, a SwiGLU MLP, tied or untied head.
"""

from rayrl.rollout.native.families.base import FAMILIES, Family


@FAMILIES.register("llama")
class Llama(Family):
    pass
