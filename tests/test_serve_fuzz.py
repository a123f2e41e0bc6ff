"""Property-based fuzzing of a live server from its own OpenAPI document (Schemathesis on Hypothesis).

Schemathesis turns ``/openapi.json`` into request strategies: valid bodies (positive mode: every field in its
documented type and bounds, which the server writes from the model, see ``routes._document``) and invalid ones
(negative mode: wrong types, out-of-range numbers, missing fields). A third mode takes positive bodies and sets a few
numeric fields to boundary values (:data:`EXTREMES`: the edges of int32, int64 and float64), which a server whose
document understates its bounds would pass to the engine. :data:`EXAMPLES` requests go to the three generating
endpoints, with a fixed :data:`SEED`; none may answer 5xx, and afterwards the engine must still be healthy and serve a
normal request. The checkpoint is tiny (random weights, a context of :data:`CONTEXT` tokens, with a chat
template), so a valid request costs a few milliseconds of engine time.
"""

from __future__ import annotations

import collections

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, seed, settings, strategies as st
from test_serve import Server
from test_serve_hostile import flat_checkpoint

SEED = 20231  # Hypothesis's seed: the same requests every run.
CONTEXT = 32
TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
# Requests per (endpoint, mode): 3 endpoints x 3 modes x these = 540 requests (EXAMPLES).
PER_STRATEGY = {"positive": 80, "negative": 50, "extreme": 50}
EXAMPLES = 3 * sum(PER_STRATEGY.values())
NUMBERS = ("steps", "steps_per_block", "top_k", "n", "max_tokens", "max_completion_tokens", "seed", "block_length")
NUMBERS += ("temperature", "top_p", "threshold")
EXTREMES = (-1, 0, 1, 2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64, 10**30, 1e308, -1e308, 5e-324, 0.5)
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/fim/completions")


@pytest.fixture(scope="module")
def server(tmp_path_factory, data_dir):
  path = flat_checkpoint(tmp_path_factory.mktemp("fuzz"), data_dir / "tokenizer.model", CONTEXT, TEMPLATE)
  # Four slots: a request asking for more choices (n <= 16) than there are slots runs them in turns, as it would on
  # any server; each batch bucket (1, 2, 4) compiles at start-up, at the test processes' quick level.
  srv = Server(path, "--slots", "4", "--compile-timeout", "1", "--request-timeout", "30", quick=True)
  yield srv
  assert srv.stop() == 0, "".join(srv.log)


def test_fuzzed_requests_never_answer_5xx_and_the_engine_stays_healthy(server):
  document = httpx.get(f"{server.url}/openapi.json").json()
  schema = schemathesis.openapi.from_dict(document)
  sent, failures = [], []

  def fuzz(path: str, mode: str, count: int) -> None:
    generation = schemathesis.GenerationMode("positive" if mode == "extreme" else mode)
    strategy = schema[path]["POST"].as_strategy(generation_mode=generation)
    extremes = st.dictionaries(st.sampled_from(NUMBERS), st.sampled_from(EXTREMES), min_size=1, max_size=3)

    @seed(SEED)
    @settings(
      max_examples=count, deadline=None, database=None, phases=[Phase.generate], suppress_health_check=list(HealthCheck)
    )
    @given(case=strategy, extreme=extremes)
    def send(case, extreme):
      if mode == "extreme" and isinstance(case.body, dict):
        case.body = {**case.body, **extreme}
      response = case.call(base_url=server.url, timeout=60)
      sent.append(response.status_code)
      if response.status_code >= 500:
        failures.append((path, mode, str(case.body)[:300], response.status_code, response.text[:300]))

    send()

  for path in ENDPOINTS:
    for mode, count in PER_STRATEGY.items():
      fuzz(path, mode, count)
  assert len(sent) >= 500, f"only {len(sent)} requests were generated"
  assert not failures, failures[:5]
  assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
  out = httpx.post(f"{server.url}/v1/completions", json={"prompt": "def f(x):", "max_tokens": 8}, timeout=60)
  assert out.status_code == 200 and out.json()["choices"][0]["finish_reason"] in ("stop", "length")
  print(f"fuzzing: {len(sent)} requests (seed {SEED}); statuses {dict(sorted(collections.Counter(sent).items()))}")
