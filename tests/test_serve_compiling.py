"""The server's compile pool: jobs in worker processes that a time limit or a client that leaves stops by killing the
process (replaced for the next job), and refusals cached."""

from __future__ import annotations

import asyncio
import os

import pytest

from mercury_jax.constrain.automaton import ConstraintError
from mercury_jax.data.tokenizer import Tokenizer
from mercury_jax.serve.compiling import CompilePool, CompilerSpec

SCHEMA = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 200}}, "required": ["a"]}


@pytest.fixture(scope="module")
def spec(data_dir) -> CompilerSpec:
  tokenizer = Tokenizer.load(data_dir / "tokenizer.model")
  return CompilerSpec(tokenizer.to_bytes(), 512, 256, 16384, "raise the capacity")


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  return True


def test_a_job_past_the_time_limit_is_refused_its_process_killed_and_the_refusal_cached(spec):
  async def main():
    pool = CompilePool(spec, workers=1, timeout=1e-4)  # No job finishes in 0.1 ms (a round trip to a process).
    pool.start()
    await pool.ready()
    first = pool._idle[0].process.pid
    try:
      with pytest.raises(ConstraintError, match="took longer than the server allows"):
        await pool.json_schema(SCHEMA)
      replaced = pool._idle[0].process.pid
      with pytest.raises(ConstraintError, match="took longer"):  # From the cache: no second job.
        await pool.json_schema(SCHEMA)
      return first, replaced, pool._idle[0].process.pid
    finally:
      pool.close()

  first, replaced, after_cached = asyncio.run(main())
  assert first != replaced and not _alive(first) and after_cached == replaced


def test_a_cancelled_job_kills_its_process_and_the_next_job_compiles(spec):
  async def main():
    pool = CompilePool(spec, workers=1, timeout=60)
    pool.start()
    await pool.ready()
    first = pool._idle[0].process.pid
    try:
      job = asyncio.ensure_future(pool.json_schema(SCHEMA))
      await asyncio.sleep(0.005)  # The job is on its process now.
      job.cancel()
      with pytest.raises(asyncio.CancelledError):
        await job
      second = pool._idle[0].process.pid
      automaton = await pool.json_schema(SCHEMA)  # Not cached: the cancelled job left nothing behind.
      assert automaton.accepts(spec_tokens(spec, '{"a":"x"}') + [automaton.eos_id])
      return first, second
    finally:
      pool.close()

  first, second = asyncio.run(main())
  assert first != second and not _alive(first)


def spec_tokens(spec: CompilerSpec, text: str) -> list[int]:
  return Tokenizer.from_bytes(spec.tokenizer).encode(text)
