"""The pacing of chunked prefills (``serve.pacing``): chunks take their share of the engine's time while other
requests decode, whatever a chunk costs against a step.

The pacer is driven here as the engine thread drives it, with made-up chunk and step times (seconds), so the
shares and gaps are exact functions of its rule: an iteration's gap is its step plus the chunks it ran.
"""

from __future__ import annotations

import statistics

import pytest

from mercury_jax.serve.pacing import IDLE_SECONDS, MAX_CHUNKS, PrefillPacer


def _prefill(pacer: PrefillPacer, chunks: int, chunk_cost, step: float) -> list[tuple[int, float]]:
  """Runs a prefill of ``chunks`` chunks beside decoding streams; ``chunk_cost(i)`` is chunk ``i``'s seconds.
  Returns each iteration's (chunks run, gap)."""
  done, iterations = 0, []
  while done < chunks:
    count = min(pacer.chunks(decoding=True), chunks - done)
    seconds = sum(chunk_cost(done + i) for i in range(count))
    done += count
    pacer.record(count, seconds, step)
    iterations.append((count, step + seconds))
  return iterations


@pytest.mark.parametrize("share", [0.25, 0.5, 0.75])
@pytest.mark.parametrize("cost", [0.1, 8.0])  # chunks a tenth of a step, and eight steps
def test_chunks_take_their_share_of_the_engine_and_the_streams_keep_the_rest(share, cost):
  """Cheap chunks run several to an iteration, costly ones every few iterations; either way the chunks' share of the
  engine's time over the prefill is the share asked for (within one chunk's rounding), so the streams' mean gap is
  ``1 / (1 - share)`` of their step, and no iteration runs more than one costly chunk."""
  step = 1.0
  iterations = _prefill(PrefillPacer(share), 400, lambda i: cost, step)
  total = sum(gap for _, gap in iterations)
  chunked = sum(count for count, _ in iterations) * cost
  assert chunked / total == pytest.approx(share, abs=0.03)
  assert statistics.mean(gap for _, gap in iterations) <= step / (1 - share) * 1.06
  if cost < step:
    assert max(count for count, _ in iterations) > 1
  else:
    assert max(count for count, _ in iterations) == 1
    assert statistics.median(gap for _, gap in iterations) == step  # most iterations only step


def test_a_chunk_that_grows_with_the_cache_keeps_the_streams_mean_gap_within_the_bound():
  """A chunk's time grows with the slots it reads: here from a fifth of a step to six steps over the prefill. The
  pacer follows its estimate: the streams' mean gap stays within ``1 / (1 - share)`` of their step (2x at the
  default) and every chunk runs."""
  pacer, step = PrefillPacer(), 0.02
  iterations = _prefill(pacer, 300, lambda i: step * (0.2 + 5.8 * i / 299), step)
  assert sum(count for count, _ in iterations) == 300
  assert statistics.mean(gap for _, gap in iterations) <= 2.0 * step * 1.06


def test_without_decoding_streams_the_chunks_run_back_to_back_in_short_iterations():
  pacer = PrefillPacer()
  assert pacer.chunks(decoding=False) == 1  # nothing measured yet: one chunk, to time it
  pacer.record(1, 0.004, None)
  assert pacer.chunks(decoding=False) == int(IDLE_SECONDS // 0.004)
  pacer.record(1, 0.5, None)  # the estimate moves towards a chunk longer than an idle iteration: one at a time
  pacer.record(1, 0.5, None)
  assert pacer.chunks(decoding=False) == 1
  fast = PrefillPacer()
  fast.record(1, 1e-6, None)
  assert fast.chunks(decoding=False) == MAX_CHUNKS


def test_steps_beside_no_chunk_are_not_banked_into_a_burst():
  """Iterations that step while the chunks wait for their turn pay back what the chunks ran ahead; once paid, more
  steps give no extra credit: the next iteration runs one iteration's share of chunks, not a burst."""
  pacer, step, cost = PrefillPacer(0.5), 1.0, 0.25
  pacer.record(1, cost, step)
  for _ in range(100):
    pacer.record(0, 0.0, step)
  assert pacer.chunks(decoding=True) <= 2 * step / cost
  pacer.idle()
  assert pacer.debt == 0.0


def test_a_costly_chunk_is_paid_back_before_the_next_one_runs():
  pacer, step = PrefillPacer(0.5), 1.0
  pacer.record(1, 1.0, step)  # estimates: a chunk and a step of a second each, nothing owed
  assert pacer.chunks(decoding=True) == 1
  pacer.record(1, 3.0, step)  # a chunk of 3 s: 2 s ahead of the share
  assert pacer.chunks(decoding=True) == 0
  pacer.record(0, 0.0, step)
  assert pacer.chunks(decoding=True) == 0  # 1 s still owed: the share of this iteration is spent on it
  pacer.record(0, 0.0, step)
  assert pacer.chunks(decoding=True) == 1


@pytest.mark.parametrize("share", [0.0, 0.99, float("nan")])
def test_a_share_outside_its_bounds_is_refused(share):
  with pytest.raises(ValueError, match=r"prefill share=.* must lie in \[0.05, 0.95\]"):
    PrefillPacer(share)
