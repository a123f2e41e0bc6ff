"""Bounds on what a caller may ask of the engine, each defined once for the library, the command lines and the server.

Plain numbers, importable without jax: the server's command line checks its flags before it loads anything.
"""

# The largest seed: ``jax.random.key`` takes a 32-bit seed (x64 off, the default), so the seeds 0 .. 2**32 - 1 give
# distinct keys, while 2**32 wraps to seed 0's key (and a negative seed to its complement's, 2**32 - |seed|).
MAX_SEED = 2**32 - 1
# The largest batch-invariant tile of positions of a serving engine (``--invariant-tile``,
# ``SlotEngine(invariant_tile=)``): a lone request pays a product over this many positions.
MAX_TILE = 1024
