"""minidi: a mini inference engine for DeepSeek-V4.1-Flash and DeepSeek-V4-Flash.

The model is plain PyTorch (``minidi.model``); speed is meant to come from ``torch.compile`` with minidi's passes
(``minidi.passes``) swapping in Triton custom ops (``minidi.ops``), installed by ``minidi.compile``
(``minidi.runtime.compile``). ``minidi.runtime`` loads checkpoints in the official layout and builds models;
``python -m minidi.inspect`` shows what the passes did.
"""

from minidi.model.config import ModelConfig
from minidi.model.presets import PRESETS, preset
from minidi.runtime.build import load_model
from minidi.runtime.engine import Engine, PrefixHandle, Request, Result
from minidi.runtime.compile import compile, uncompile

__all__ = ["ModelConfig", "PRESETS", "preset", "load_model", "Engine", "Request", "Result", "PrefixHandle",
           "compile", "uncompile"]
__version__ = "0.1.0"
