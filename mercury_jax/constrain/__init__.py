"""Structured output: constraints (regexes, JSON Schemas) compiled on the host into token-level automata of plain
arrays (:mod:`~mercury_jax.constrain.automaton`), which the decoding engine runs over on the device
(:mod:`~mercury_jax.sampling.automata`).

The host half (outlines-core, jsonschema) is imported on first use of its names, so decoding without a constraint
never loads it.
"""

import importlib

_LAZY = {
  "Automaton": "mercury_jax.constrain.automaton",
  "Compiler": "mercury_jax.constrain.automaton",
  "ConstraintError": "mercury_jax.constrain.automaton",
  "tool_call_schema": "mercury_jax.constrain.schema",
}
__all__ = list(_LAZY)


def __getattr__(name: str):
  if name not in _LAZY:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  return getattr(importlib.import_module(_LAZY[name]), name)
