"""The names of the files and folders that mercury_jax writes and reads, each defined once.

- A prepared data folder (``python -m mercury_jax.prepare``) holds :data:`TOKENIZER_FILE`, :data:`MANIFEST_FILE`
  (what went in) and :data:`METADATA_FILE` (what came out: splits, shards, the corpus) beside its record shards.
- A train workdir holds :data:`CHECKPOINTS`, Orbax's step folders (each with the items of ``checkpoint.ITEMS``,
  :data:`PARAMS` among them), and the data's :data:`TOKENIZER_FILE`.
- An inference checkpoint (``python -m mercury_jax.export``; ``python -m mercury_jax.convert``) holds step folders
  of :data:`PARAMS` and the config, the tokenizer, a :data:`CARD_FILE`, and (export) the data's manifest and
  metadata.
"""

TOKENIZER_FILE = "tokenizer.model"  # The sentencepiece tokenizer of a data folder, a workdir or a checkpoint.
MANIFEST_FILE = "manifest.json"  # A prepared data folder's inputs: which files went in.
METADATA_FILE = "metadata.json"  # A prepared data folder's description: its splits, shards and corpus.
CARD_FILE = "MODEL_CARD.md"  # The model card of an exported or converted checkpoint.
CHECKPOINTS = "checkpoints"  # A train workdir's folder of Orbax step folders.
PARAMS = "params"  # A step folder's parameters item.
ORBAX_COMMIT_MARKER = "commit_success.txt"  # What Orbax leaves in a finished step; an inference checkpoint drops it.
