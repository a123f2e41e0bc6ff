"""Test set-up: 8 simulated CPU devices (set before jax is imported anywhere) and the `gpu` marker."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures"


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


def pytest_collection_modifyitems(config, items):
  if jax.default_backend() == "gpu":
    return
  skip = pytest.mark.skip(reason="needs a GPU")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)
