"""Test set-up: 8 simulated CPU devices and quick compilation (set before jax is imported anywhere), one persistent
compilation cache for the whole run, and the `gpu` marker."""

import atexit
import os
import shutil
import tempfile

# The suite's tiny models spend most of their time in XLA:CPU's compiler: LLVM at -O0 without its expensive passes
# halves the wall time of compile-bound test files (104 s -> 57 s for test_chunked_prefill + test_init_from) and
# changes no test's outcome (the matmuls run in precompiled library kernels at every level). An XLA_FLAGS that sets
# the level itself wins.
_QUICK = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
# XLA:CPU splits a program's LLVM module into parts that its JIT compiles on several threads; twice a suite run died
# of a segmentation fault inside that compilation (backend_compile_and_load of a serving step, never the same test
# twice). One part per program compiles on the calling thread only; with two test processes on two cores the
# parallel split bought nothing.
_QUICK += " --xla_cpu_parallel_codegen_split_count=1"
# XLA:CPU's MLIR fusion emitters take several times longer to compile a fusion than its older loop emitters, and the
# tests compile far more than they run: with the older ones a serving engine's warm-up (every prefill and step
# bucket) compiled in 13-24 s instead of 47-50 s, test_engine.py ran in 246 s instead of 392 s, and 300 training
# steps ran as fast (interleaved runs; docs/results/tests.md).
_QUICK += " --xla_cpu_use_fusion_emitters=false"
_FLAGS = os.environ.get("XLA_FLAGS", "")
_FLAGS += "" if "xla_backend_optimization_level" in _FLAGS else f" {_QUICK}"
os.environ["XLA_FLAGS"] = f"{_FLAGS} --xla_force_host_platform_device_count=8".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One compilation cache for the run, empty at its start: the test processes (pytest's and its xdist workers, which
# inherit the variable from the process that made the folder) and the commands they start (``python -m
# mercury_jax.sample``/``serve``, under $XDG_CACHE_HOME) share it, so a program that many tests build alike (the same
# model through a new Sampler, a server started again) compiles once. Nothing reads the user's own cache.
_CACHE_HOME = os.environ.get("MERCURY_JAX_TEST_CACHE_HOME")
if _CACHE_HOME is None:
  _CACHE_HOME = os.environ["MERCURY_JAX_TEST_CACHE_HOME"] = tempfile.mkdtemp(prefix="mercury_jax_test_cache_")
  atexit.register(shutil.rmtree, _CACHE_HOME, ignore_errors=True)
os.environ["XDG_CACHE_HOME"] = _CACHE_HOME

from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures"

from mercury_jax.sample import enable_compile_cache  # noqa: E402

enable_compile_cache()  # Bounded, so JAX locks the folder around every read and write of the processes sharing it.
# Programs that compile in under 0.3 s (eager operations, small helpers) are cheaper to rebuild than to store.
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.3)


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> Path:
  """The fixture corpus prepared once per test session (vocabulary 400, sequences of 64); read-only for tests."""
  from mercury_jax.prepare import main as prepare_main

  out = tmp_path_factory.mktemp("data") / "fixture"
  code = prepare_main(
    ["--corpus", str(FIXTURES / "corpus" / "**" / "*"), "--out", str(out), "--vocab-size", "400", "--seq-len", "64"]
  )
  assert code in (0, None)
  return out


# The files that take longest on 2 cores, longest first: those whose items led a full run's ``--durations=120`` list
# (2026-12-06; the structured-output files before their suites were halved). ``--dist loadfile`` hands whole files to
# the workers in collection order (``--no-loadscope-reorder`` in pyproject's addopts; xdist's own order, by number of
# tests, left most of these for the end), so they start first and the run ends on short files.
LONGEST_FIRST = (
  "test_latent_decoding.py",
  "test_chunked_serving.py",
  "test_structured.py",
  "test_multiprocess.py",
  "test_paged_serving.py",
  "test_context_parallel.py",
  "test_default_model.py",
  "test_verified_entry_points.py",
  "test_serve.py",
  "test_needle.py",
  "test_train.py",
  "test_bench.py",
  "test_serve_hostile.py",
  "test_serve_engine.py",
  "test_engine.py",
  "test_default_chat.py",
)


def pytest_collection_modifyitems(config, items):
  rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep pytest's order
  if jax.default_backend() == "gpu":
    return
  skip = pytest.mark.skip(reason="needs a GPU")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)
