"""The budget of the compile attempt running in this context (a :class:`~mercury_jax.constrain.fsa.Budget` with
``work``), for the steps that no one automaton's size bounds: refining a partition (:mod:`.minimize`), which takes
no budget of its own. Set by :func:`~mercury_jax.constrain.schema.compile_schema` around each attempt."""

from __future__ import annotations

import contextlib
import contextvars

_ACTIVE = contextvars.ContextVar("mercury_jax_constrain_budget", default=None)


@contextlib.contextmanager
def active(budget):
  """``budget`` counts :func:`spend` within the block."""
  token = _ACTIVE.set(budget)
  try:
    yield budget
  finally:
    _ACTIVE.reset(token)


def spend(work: int) -> None:
  """Counts ``work`` on the active budget, if any (it raises ``fsa.Exhausted`` past its ``work``)."""
  budget = _ACTIVE.get()
  if budget is not None:
    budget.spend(work)
