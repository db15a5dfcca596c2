"""``python -m minidi.inspect --model tiny-v41 --out DIR``: the graphs before and after minidi's passes (see
``minidi/passes/inspect_cli.py``)."""

from minidi.passes.inspect_cli import inspect_model, main

__all__ = ["inspect_model", "main"]

if __name__ == "__main__":
    raise SystemExit(main())
