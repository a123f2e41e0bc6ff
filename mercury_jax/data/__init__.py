"""Data: corpora, the tokenizer, packed ArrayRecord records and the grain input pipeline.

``python -m mercury_jax.prepare`` turns a corpus into a data directory; ``pipeline`` reads it for training and
evaluation. See ``records`` for the record format.
"""

from mercury_jax.data.pipeline import eval_batches, load_tokenizer, read_metadata, to_global, train_dataset
from mercury_jax.data.tokenizer import Tokenizer, train_tokenizer

__all__ = [
  "Tokenizer",
  "eval_batches",
  "load_tokenizer",
  "read_metadata",
  "to_global",
  "train_dataset",
  "train_tokenizer",
]
