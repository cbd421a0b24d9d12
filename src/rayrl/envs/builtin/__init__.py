"""Built-in tools, registered in ``TOOLS`` on import: ``calculator``,
``code_interpreter`` (alias ``python``), ``sandbox_fusion`` (code on a SandboxFusion
server), ``search``, ``gsm8k_answer``, ``look`` (a region of an image, for a
vision-language model)."""

from rayrl.envs.builtin.calculator import Calculator
from rayrl.envs.builtin.gsm8k import Gsm8kAnswer
from rayrl.envs.builtin.look import Look
from rayrl.envs.builtin.python_code import PythonInterpreter
from rayrl.envs.builtin.sandbox_fusion import SandboxFusionTool
from rayrl.envs.builtin.search import BM25, LocalSearch

__all__ = [
    "BM25",
    "Calculator",
    "Gsm8kAnswer",
    "LocalSearch",
    "Look",
    "PythonInterpreter",
    "SandboxFusionTool",
]
