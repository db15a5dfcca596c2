"""Compiler passes that swap the model's naive subgraphs for minidi's Triton ops (one rewrite per file).

``PassManager`` runs the rewrites on Dynamo's FX graph; ``minidi.compile`` (``minidi/runtime/compile.py``) installs
it in a ``torch.compile`` backend. This package knows passes, not models, and imports nothing from ``minidi.runtime``.
"""

from .manager import BY_KEY, REWRITES, PassManager, PassMatchError, select

__all__ = ["BY_KEY", "REWRITES", "PassManager", "PassMatchError", "select"]
