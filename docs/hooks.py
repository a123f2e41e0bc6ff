"""MkDocs hook: the docstrings' Sphinx roles (:class:`~mercury_jax.x.Y`) shown as code, as a reader expects."""

import re

_ROLE = re.compile(r":(?:mod|class|func|meth|data|attr|exc|obj):<code>(~?)([^<]+)</code>")


def _code(match: re.Match) -> str:
  short, target = match.groups()
  return f"<code>{target.rsplit('.', 1)[-1] if short else target}</code>"


def on_page_content(html: str, **kwargs) -> str:
  return _ROLE.sub(_code, html)
