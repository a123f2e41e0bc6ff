"""The server returns the compiler's warning line for a schema in the ``x-schema-warnings`` header (docs/server.md).

The requests go through the real routes (``create_app``) with the fake scheduler of ``test_serve_protocol`` and the
real compiler (bundled tokenizer) in the process, in place of the compile pool.
"""

from __future__ import annotations

import pytest
from test_automaton import TOKENIZER
from test_serve_protocol import TEMPLATE, FakeScheduler, client_for, sse

from mercury_jax.constrain import Compiler
from mercury_jax.data.tokenizer import Tokenizer
from mercury_jax.serve import structured

pytestmark = pytest.mark.filterwarnings("ignore::mercury_jax.constrain.automaton.SchemaWarning")  # the header has it

WITH_EXTRAS = {
  "type": "object",
  "properties": {"city": {"type": "string", "format": "postal-town"}, "note": {"type": "string", "maxLength": 9000}},
  "required": ["city"],
  "x-generator": "handwritten",
}


class InProcessCompiler:
  """The compile pool's interface over a :class:`Compiler` in this process."""

  def __init__(self):
    self.compiler = Compiler(Tokenizer.load(TOKENIZER))

  async def regex(self, pattern):
    return self.compiler.regex(pattern)

  async def json_schema(self, schema):
    return self.compiler.json_schema(schema)

  async def json_object(self):
    return self.compiler.json_object()


@pytest.fixture(scope="module")
def compiler():
  return InProcessCompiler()


def test_the_warning_line_of_a_schema_comes_back_in_a_header_streamed_or_not(compiler):
  client = client_for(FakeScheduler('{"city":"x"}', compiler=compiler))
  response_format = {"type": "json_schema", "json_schema": {"name": "place", "schema": WITH_EXTRAS}}
  whole = client.post("/v1/completions", json={"prompt": "x", "response_format": response_format})
  header = whole.headers[structured.WARNING_HEADER]
  assert "'x-generator' at (root)" in header and "format 'postal-town' at properties.city" in header, header
  assert "maxLength=9000 at properties.note.maxLength is written as at most 256" in header, header
  streamed = client.post("/v1/completions", json={"prompt": "x", "response_format": response_format, "stream": True})
  assert streamed.headers[structured.WARNING_HEADER] == header and sse(streamed)
  plain = {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "object"}}}
  for body in ({"prompt": "x", "response_format": plain}, {"prompt": "x"}):
    assert structured.WARNING_HEADER not in client.post("/v1/completions", json=body).headers


def test_a_tool_call_that_may_be_text_keeps_the_warnings_of_its_parameters(compiler):
  client = client_for(FakeScheduler("Hello", compiler=compiler, template=TEMPLATE, context=256))
  tool = {"type": "function", "function": {"name": "find", "parameters": WITH_EXTRAS}}
  for choice in ("auto", "required"):
    body = {"messages": [{"role": "user", "content": "where?"}], "tools": [tool], "tool_choice": choice}
    header = client.post("/v1/chat/completions", json=body).headers[structured.WARNING_HEADER]
    assert "'x-generator' at properties.arguments" in header, (choice, header)


def test_the_header_is_ascii_whatever_the_keyword():
  class Warned:
    warnings = ("read as annotations and ignored: 'größe' at (root)",)

  expected = "read as annotations and ignored: 'gr\\xf6\\xdfe' at (root)"
  assert structured.warning_headers(Warned()) == {structured.WARNING_HEADER: expected}
  assert structured.warning_headers(None) == {}
