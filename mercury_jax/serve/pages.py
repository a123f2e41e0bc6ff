"""The host's side of the paged key-value cache: the free list of the pool's pages, and who holds which.

The device side is :class:`~mercury_jax.kvcache.PagedKVCache`; :class:`~mercury_jax.serve.slots.SlotEngine` takes a
request's pages at admission and gives them back at release, on process 0 (the others receive each admission's pages
in its command).
"""

from __future__ import annotations

from mercury_jax.kvcache import SINK


class NoPages(Exception):
  """The page pool has too few free pages for a request now: it waits for running requests to give theirs back."""


class PagePool:
  """The host's free list of the paged cache's pages (page 0, the sink, is never handed out).

  Args:
    pages: Pages of the pool, the sink included.
  """

  def __init__(self, pages: int):
    self.pages = pages
    self.free: list[int] = list(range(pages - 1, SINK, -1))  # popped from the end: low pages first
    self.held: dict[int, list[int]] = {}  # slot -> its pages

  @property
  def capacity(self) -> int:
    """Pages a request can ever hold (every page but the sink)."""
    return self.pages - 1

  def take(self, slot: int, count: int) -> list[int]:
    """``count`` pages for ``slot`` (which holds none); raises :class:`NoPages` when fewer are free."""
    assert slot not in self.held, f"slot {slot} already holds pages"
    if count > len(self.free):
      raise NoPages(f"{count} pages needed, {len(self.free)} free")
    self.held[slot] = [self.free.pop() for _ in range(count)]
    return self.held[slot]

  def give_back(self, slot: int) -> None:
    """``slot``'s pages (if any) back to the free list."""
    self.free.extend(reversed(self.held.pop(slot, [])))

  def reset(self) -> None:
    self.__init__(self.pages)
