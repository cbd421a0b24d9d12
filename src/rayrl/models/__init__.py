"""Models: tiny random-weight Qwen2 models and the tokenizer factory they use.

`build_tiny_model` writes a Hugging Face directory that loads offline;
`train_tokenizer` trains the byte-level BPE tokenizer with ChatML tokens it ships with.
"""

from rayrl.models.tiny import TinySpec, build_tiny_model, count_parameters, reference_05b
from rayrl.models.tokenizer import train_tokenizer

__all__ = ["TinySpec", "build_tiny_model", "count_parameters", "reference_05b", "train_tokenizer"]
