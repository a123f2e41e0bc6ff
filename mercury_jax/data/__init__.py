"""Data: corpora, the tokenizer, packed ArrayRecord records and the grain input pipeline.

``python -m mercury_jax.prepare`` turns a corpus into a data directory; ``pipeline`` reads it for training and
evaluation. See ``records`` for the record format.

The package imports none of its modules: sampling needs only ``tokenizer``, and ``pipeline`` would bring grain into
every ``python -m mercury_jax.sample`` (about 0.24 s of imports, ``python -X importtime``).
"""
