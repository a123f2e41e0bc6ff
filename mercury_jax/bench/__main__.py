"""``python -m mercury_jax.bench``: see :mod:`mercury_jax.bench.cli`."""

from mercury_jax.bench.cli import main

main()
