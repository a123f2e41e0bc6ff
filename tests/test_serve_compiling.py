"""The server's compile pool: each job a child forked from one zygote process, killed when it runs past its time limit
or every requester leaves (no process starts again); refusals cached; cheap jobs answered while hostile ones run."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

from mercury_jax.constrain.automaton import ConstraintError
from mercury_jax.data.tokenizer import Tokenizer
from mercury_jax.serve.compiling import CompilePool, CompilerSpec

SCHEMA = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 200}}, "required": ["a"]}
# A four-field object (more than 1 MiB of address space to compile).
PERSON = {
  "type": "object",
  "properties": {
    "name": {"type": "string", "maxLength": 40},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 5},
  },
  "required": ["name", "age"],
}


def hostile(i: int) -> str:
  """A regex whose static size estimate (``regexes.min_states``) takes the compiler tens of seconds: the integers from
  a bound near 2**70, as nested alternatives (a different bound each: no cache or shared job helps). A JSON Schema's
  bounds no longer make one: the schema compiler (mercury_jax.constrain) builds them in milliseconds."""
  digits, regex = str(2**70 - 7 - i), ""
  for k in reversed(range(len(digits))):
    d, rest = int(digits[k]), len(digits) - k - 1
    higher = f"|[{d + 1}-9]" + (f"\\d{{{rest}}}" if rest else "") if d < 9 else ""
    regex = f"{digits[k]}(?:{regex}){higher}"
  return f"(?:{regex})|[1-9]\\d{{{len(digits)},}}"


@pytest.fixture(scope="module")
def spec(data_dir) -> CompilerSpec:
  tokenizer = Tokenizer.load(data_dir / "tokenizer.model")
  return CompilerSpec(tokenizer.to_bytes(), 512, 256, 16384, "raise the capacity")


def _children(pid: int) -> list[int]:
  """The live (not zombie) child processes of ``pid`` (Linux /proc)."""
  found = []
  for entry in Path("/proc").iterdir():
    if entry.name.isdigit():
      try:
        state, parent = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:2]
      except OSError:
        continue
      if int(parent) == pid and state != "Z":
        found.append(int(entry.name))
  return found


def _run(spec: CompilerSpec, main, **options):
  """``main(pool)`` on a started pool, closed afterwards."""

  async def run():
    pool = CompilePool(spec, **options)
    pool.start()
    await pool.ready()
    try:
      return await main(pool)
    finally:
      pool.close()

  return asyncio.run(run())


def test_a_job_past_the_time_limit_is_refused_its_child_killed_and_the_refusal_cached(spec):
  async def main(pool):
    with pytest.raises(ConstraintError, match="took longer than the server allows"):
      await pool.json_schema(SCHEMA)  # No job finishes in 0.1 ms (a fork and a round trip).
    zygote = pool._zygote.process.pid
    await asyncio.sleep(0.2)
    left = _children(zygote)
    with pytest.raises(ConstraintError, match="took longer"):  # From the cache of refusals: no second job.
      await pool.json_schema(SCHEMA)
    return left, pool.counts, pool._zygote.process.pid == zygote

  left, counts, same = _run(spec, main, workers=1, timeout=1e-4)
  assert not left and counts["jobs"] == 1 and counts["cached"] == 1 and counts["timeouts"] == 1 and same


def test_a_job_every_requester_left_is_killed_and_the_next_job_compiles(spec):
  async def main(pool):
    zygote = pool._zygote.process.pid
    jobs = [asyncio.ensure_future(pool.regex(hostile(0))) for _ in range(2)]  # one job, two requesters
    while not _children(zygote):
      await asyncio.sleep(0.01)
    jobs[0].cancel()
    await asyncio.sleep(0.2)
    running = len(_children(zygote))  # the other requester still waits for it
    jobs[1].cancel()
    await asyncio.gather(*jobs, return_exceptions=True)
    await asyncio.sleep(0.2)
    left = _children(zygote)
    automaton = await pool.json_schema(SCHEMA)  # Not cached: the cancelled job left nothing behind.
    ids = Tokenizer.from_bytes(spec.tokenizer).encode('{"a":"x"}')
    return running, left, automaton.accepts(ids + [automaton.eos_id]), pool.counts

  running, left, accepts, counts = _run(spec, main, timeout=60)
  assert running == 1 and not left and accepts
  assert counts["jobs"] == 2 and counts["shared"] == 1 and counts["killed"] == 1


def test_a_cheap_schema_answers_while_eight_hostile_ones_compile(spec):
  """8 schemas that run past the time limit, then a boolean: the boolean is answered before any of them (each gets
  its express time, then two go on in the general places and six wait for one); all 8 are refused, and asked again
  they answer from the cache of refusals."""

  async def main(pool):
    slow = [asyncio.ensure_future(pool.regex(hostile(i))) for i in range(8)]
    await asyncio.sleep(0.1)
    began = time.perf_counter()
    automaton = await pool.json_schema({"type": "boolean"})
    cheap = time.perf_counter() - began
    ended = sum(job.done() for job in slow)
    refusals = await asyncio.gather(*slow, return_exceptions=True)
    again = time.perf_counter()
    with pytest.raises(ConstraintError, match="took longer"):
      await pool.regex(hostile(3))
    return automaton, cheap, ended, refusals, time.perf_counter() - again, pool.counts

  # An express second: on a 2-core host at load 15 the boolean's job took 0.5-0.75 s beside the eight.
  automaton, cheap, ended, refusals, cached, counts = _run(spec, main, timeout=3.0, express_seconds=1.0)
  print(f"boolean answered in {cheap:.3f} s beside 8 hostile schemas; the refusal from the cache in {cached:.4f} s")
  assert automaton.num_states > 1 and ended == 0
  assert all(isinstance(r, ConstraintError) and "took longer" in str(r) for r in refusals), refusals
  assert counts["continued"] == 2 and counts["requeued"] == 6 and counts["timeouts"] == 8
  assert counts["jobs"] == 8 + 6 + 1 and counts["cached"] == 1


def test_a_job_past_the_express_memory_compiles_in_a_general_place(spec):
  async def main(pool):
    return await pool.json_schema(PERSON), pool.counts

  # Express time enough that the job dies of its memory there, however loaded the host.
  automaton, counts = _run(spec, main, timeout=60, express_memory=1 << 20, express_seconds=30)
  ids = Tokenizer.from_bytes(spec.tokenizer).encode('{"name":"x","age":7}')
  assert automaton.accepts(ids + [automaton.eos_id])
  assert counts["requeued"] == 1 and counts["jobs"] == 2


def test_a_dead_zygote_is_started_again(spec):
  async def main(pool):
    first = pool._zygote.process.pid
    os.kill(first, signal.SIGKILL)
    pool._zygote.process.wait()
    automaton = await pool.json_schema(SCHEMA)
    return first, pool._zygote.process.pid, automaton

  first, second, automaton = _run(spec, main, timeout=60)
  assert first != second and automaton.num_states > 1
