"""Bounds on what a caller may ask of the engine, each defined once for the library, the command lines and the server.

Plain numbers, importable without jax: the server's command line checks its flags before it loads anything.
"""

from typing import NamedTuple

# The largest seed: ``jax.random.key`` takes a 32-bit seed (x64 off, the default), so the seeds 0 .. 2**32 - 1 give
# distinct keys, while 2**32 wraps to seed 0's key (and a negative seed to its complement's, 2**32 - |seed|).
MAX_SEED = 2**32 - 1
# The largest batch-invariant tile of positions of a serving engine (``--invariant-tile``,
# ``SlotEngine(invariant_tile=)``): a lone request pays a product over this many positions.
MAX_TILE = 1024
MAX_GUIDANCE = 16.0  # The largest classifier-free guidance scale of a continuous checkpoint's ``ode`` rule.
SOLVERS = ("euler", "heun")  # The ``ode`` rule's solvers.


class Capacity(NamedTuple):
  """The padded sizes of a batch's structured-output automata (static: one compilation per capacity): a server's
  ``--constraint-capacity``, what each of its slots holds."""

  states: int
  classes: int
  edges: int
