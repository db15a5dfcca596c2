"""Compiler passes that swap the model's naive subgraphs for minidi's Triton ops (one rewrite per file).

``minidi.compile(model, passes="all")`` is the entry point; ``PassManager`` runs the rewrites on Dynamo's FX graph.
"""

from .manager import (BY_KEY, REWRITES, PassManager, PassMatchError, compile, expected_sites, make_backend,
                      select)

__all__ = ["BY_KEY", "REWRITES", "PassManager", "PassMatchError", "compile", "expected_sites", "make_backend",
           "select"]
