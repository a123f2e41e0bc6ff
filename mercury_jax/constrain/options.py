"""The JSON Schema compiler's settings."""

from __future__ import annotations

import dataclasses

DRAFTS = ("4", "6", "7", "2019-09", "2020-12")


@dataclasses.dataclass(frozen=True)
class Options:
  """How JSON Schemas are read and written.

  Attributes:
    draft: The draft of a schema without ``$schema``: one of :data:`DRAFTS`, or ``"auto"`` (the default): draft
      2020-12, unless the schema uses a form only earlier drafts define (``items`` as a list, ``additionalItems``,
      ``dependencies``, an ``$id`` with a fragment; draft 4's root ``id`` or boolean ``exclusiveMinimum``), then
      draft 7 (draft 4 for those last two). A ``$schema`` naming a draft always wins. The server has the same
      default: tool schemas are mostly written in draft 7's style, and the forms that differ are recognized.
    strict: Refuse keywords and formats the compiler does not know, instead of reading them as annotations (the
      specification's rule, and the default: they are ignored and listed in the automaton's warnings).
    exact_numbers: Numbers without bounds may have any number of digits and any exponent. By default they have at
      most :data:`~mercury_jax.constrain.numbers.DIGITS` digits before and after the point and an exponent of at
      most two digits, so every number written parses to a finite, nonzero-where-written IEEE double.
    recursion_depth: Levels a recursive ``$ref`` is unrolled to.
    narrow: Where a schema's whole language does not fit the compiler's limits (or is not regular:
      ``uniqueItems`` over unbounded items), write a subset of it instead of refusing: shorter strings and
      arrays, fewer alternatives, shallower recursion and "any value", fewer optional properties, in the steps of
      :data:`~mercury_jax.constrain.schema.LADDER`, each named in the automaton's warning line. Every text written
      still validates. False refuses instead (the fixed caps on long strings and arrays still apply).
  """

  draft: str = "auto"
  strict: bool = False
  exact_numbers: bool = False
  recursion_depth: int = 4
  narrow: bool = True

  def __post_init__(self):
    if self.draft != "auto" and self.draft not in DRAFTS:
      raise ValueError(f"draft={self.draft!r} must be 'auto' or one of {', '.join(DRAFTS)}")
    if self.recursion_depth < 1:
      raise ValueError(f"recursion_depth={self.recursion_depth} must be >= 1")

  @property
  def key(self) -> str:
    """The settings as text, for cache keys."""
    return (
      f"draft={self.draft} strict={self.strict} exact_numbers={self.exact_numbers} "
      f"recursion_depth={self.recursion_depth} narrow={self.narrow}"
    )
