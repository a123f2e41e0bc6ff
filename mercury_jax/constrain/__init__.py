"""Structured output: constraints (regexes, JSON Schemas) compiled on the host into token-level automata of plain
arrays (:mod:`~mercury_jax.constrain.automaton`), which the sampling loop runs over on the device
(:mod:`~mercury_jax.constrain.device`)."""

from mercury_jax.constrain.automaton import Automaton, Compiler, ConstraintError
from mercury_jax.constrain.schema import tool_call_schema

__all__ = ["Automaton", "Compiler", "ConstraintError", "tool_call_schema"]
