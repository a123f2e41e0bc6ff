"""The one error of constraint compiling."""

from __future__ import annotations


class ConstraintError(ValueError):
  """A constraint that cannot be compiled.

  Args:
    message: One line: what is wrong and what would be right.
    param: The offending part, e.g. a schema keyword path like ``"properties.age.multipleOf"``, or None.
  """

  def __init__(self, message: str, param: str | None = None):
    super().__init__(message)
    self.param = param
