"""The Hugging Face tokenizer backend, on tiny real byte-level BPE tokenizers laid out like LLaDA's and Qwen's.

Each family's special tokens are added after training, so their ids sit above the BPE pieces (as in the real
checkpoints), never at mercury_jax's 0-4. Chat rendering is checked against ``transformers`` on the same template.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

import mercury_jax
from mercury_jax.constrain import Compiler
from mercury_jax.data import hf_tokenizer
from mercury_jax.data.chat_template import chat_template_of, prompt_ids
from mercury_jax.data.hf_files import SpecialTokens, read_chat_template, write_special_tokens
from mercury_jax.data.hf_tokenizer import HFTokenizer
from mercury_jax.data.tokenizer import TextTokenizer, Tokenizer, load_tokenizer, tokenizer_from_bytes
from mercury_jax.sampling import healing

SENTENCEPIECE = Path(mercury_jax.__file__).parent / "assets" / "default" / "tokenizer.model"
BPE_SIZE = 700

LLADA_SPECIALS = [
  "<|startoftext|>",
  "<|endoftext|>",
  "<|start_header_id|>",
  "<|end_header_id|>",
  "<|eot_id|>",
  "<|mdm_mask|>",
]
# LLaDA-8B-Instruct's tokenizer_config.json template (dllm-formats notes, (a) 7): bos_token once, Llama-3 headers,
# content trimmed, and always the assistant header at the end.
LLADA_TEMPLATE = (
  "{% set loop_messages = messages %}{% for message in loop_messages %}"
  "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim"
  " + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
  "{% endfor %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
)
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
QWEN_TEMPLATE = (
  "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
  "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
  "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
  "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
MESSAGES = [
  {"role": "system", "content": "You write Python."},
  {"role": "user", "content": "  Write fib(n), naïvely; 中文 ok?  "},
  {"role": "assistant", "content": "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)"},
  {"role": "user", "content": 'Now in JSON: {"name": 1}'},
]
TEXTS = [
  "hello world, the quick brown fox",
  "def fib(n):\n    if n < 2:\n        return n\n\treturn fib(n-1) + fib(n-2)  # tabs & spaces\n",
  "naïve café — 中文字符 😀 Ωμέγα ✓",
  "   leading and trailing   \n\n",
  "",
]


def corpus() -> list[str]:
  words = ["def", "return", "self", "value", "name", "print", "the", "model", "token", "class", "import", "json"]
  lines = []
  for i in range(400):
    a, b = words[i % len(words)], words[(i * 7) % len(words)]
    lines.append(f"{a} {b}_{i % 13}({b}, {i}):\n    {a}.{b} = [{i}, {i * 3}]  # café naïve é")
    lines.append(f'{{"{a}": "{b} {i}", "n": {i % 97}}} the {b} of the {a}')
  return lines


def build(directory: Path, specials: list[str], special: SpecialTokens, config: dict, template_file: str | None):
  """Trains a byte-level BPE, adds the family's special tokens after its pieces, and writes a converted folder."""
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=BPE_SIZE, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
  )
  tok.train_from_iterator(corpus(), trainer)
  tok.add_special_tokens(specials)
  first = tok.token_to_id(specials[0])
  # A post-processor that adds BOS, as some checkpoints ship: encode must not use it.
  tok.post_processor = processors.TemplateProcessing(single=f"{specials[0]} $A", special_tokens=[(specials[0], first)])
  directory.mkdir(parents=True)
  tok.save(str(directory / "tokenizer.json"))
  (directory / "tokenizer_config.json").write_text(json.dumps(config))
  if template_file is not None:
    (directory / "chat_template.jinja").write_text(template_file)
  write_special_tokens(directory, special)
  return tok


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
  root = tmp_path_factory.mktemp("hf")
  llada_ids = {t: BPE_SIZE + i for i, t in enumerate(LLADA_SPECIALS)}  # what add_special_tokens gives
  llada = SpecialTokens(
    bos_id=llada_ids["<|startoftext|>"],
    eos_id=llada_ids["<|endoftext|>"],
    pad_id=llada_ids["<|endoftext|>"],
    mask_id=llada_ids["<|mdm_mask|>"],
    stop_ids=(llada_ids["<|eot_id|>"],),
    add_bos=True,
  )
  config = {"bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}
  tok = build(root / "llada", LLADA_SPECIALS, llada, {**config, "chat_template": LLADA_TEMPLATE}, None)
  assert {t: tok.token_to_id(t) for t in LLADA_SPECIALS} == llada_ids
  qwen_ids = {t: BPE_SIZE + i for i, t in enumerate(QWEN_SPECIALS)}
  qwen = SpecialTokens(
    eos_id=qwen_ids["<|endoftext|>"],
    pad_id=qwen_ids["<|endoftext|>"],
    mask_id=qwen_ids["<|mask|>"],
    stop_ids=(qwen_ids["<|im_end|>"], qwen_ids["<|endoftext|>"]),
  )
  config = {"eos_token": {"content": "<|endoftext|>", "special": True}, "pad_token": "<|endoftext|>"}
  config["chat_template"] = "{{ 'overridden by chat_template.jinja' }}"
  build(root / "qwen", QWEN_SPECIALS, qwen, config, QWEN_TEMPLATE)
  return {"llada": root / "llada", "qwen": root / "qwen"}


@pytest.fixture(scope="module")
def llada(folders) -> HFTokenizer:
  return HFTokenizer.load(folders["llada"])


@pytest.fixture(scope="module")
def qwen(folders) -> HFTokenizer:
  return HFTokenizer.load(folders["qwen"])


@pytest.fixture(scope="module")
def sentencepiece() -> Tokenizer:
  return Tokenizer.load(SENTENCEPIECE)


@pytest.mark.parametrize("family", ["llada", "qwen"])
@pytest.mark.parametrize("text", TEXTS)
def test_decode_inverts_encode(family, text, request):
  tok = request.getfixturevalue(family)
  ids = tok.encode(text)
  assert tok.decode(ids) == text
  assert int(tok.characters_per_token()[ids].sum()) == len(text)
  assert tok.encode_batch([text, text]) == [ids, ids]


def test_special_ids_come_from_the_files(llada, qwen):
  assert isinstance(llada, TextTokenizer) and isinstance(qwen, TextTokenizer)
  assert (llada.bos_id, llada.eos_id, llada.pad_id, llada.mask_id) == (700, 701, 701, 705)
  assert llada.stop_ids == (701, 704) and llada.add_bos and llada.unk_id == llada.pad_id
  assert qwen.eos_id == qwen.pad_id == 700 and qwen.mask_id == 703 and not qwen.add_bos
  assert qwen.stop_ids == (700, 702) and qwen.bos_id == qwen.eos_id  # no BOS: the document boundary stands in
  assert llada.vocab_size == BPE_SIZE + len(LLADA_SPECIALS)
  assert np.flatnonzero(llada.special_mask).tolist() == list(range(700, 706))


def test_encode_adds_no_bos_but_reads_special_texts(llada):
  ids = llada.encode("<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>")
  assert ids[0] == 702 and ids[-1] == 704 and 703 in ids and 700 not in ids
  assert llada.decode(ids) == "user\n\nhi"  # special ids write no text


def test_the_mask_text_never_encodes_to_the_mask_id(llada):
  text = "a <|mdm_mask|> b<|mdm_mask|>"
  ids = llada.encode(text)
  assert llada.mask_id not in ids and llada.decode(ids) == text
  assert llada.mask_id not in llada.encode_batch([text])[0]


def test_decode_renders_masks_and_stops_at_any_stop_id(llada):
  hello = llada.encode("hello")
  ids = [llada.bos_id, *hello, llada.mask_id, *hello, 704, *hello]
  assert llada.decode(ids, mask_text="_") == "hello_hellohello"
  assert llada.decode(ids, stop_at_eos=True) == "hellohello"
  assert llada.decode([*hello, llada.vocab_size + 3]) == "hello\ufffd"  # an id past the tokenizer


def test_token_bytes_of_a_split_character_add_up(llada):
  text = "龘"  # not in the corpus: its three UTF-8 bytes stay separate byte-level pieces
  ids = llada.encode(text)
  assert len(ids) > 1
  assert b"".join(llada.token_bytes(i) for i in ids) == text.encode()
  assert "\ufffd" in llada.decode(ids[:1])  # one piece alone is part of a character
  assert llada.token_bytes(llada.encode(" the")[0]).startswith(b" ")  # Ġ is a space
  assert llada.token_bytes(llada.mask_id) == b""


def test_byte_table_is_gpt2s():
  table = hf_tokenizer.bytes_to_unicode()
  assert set(table.values()) == set(pre_tokenizers.ByteLevel.alphabet()) and len(table) == 256
  assert (table[ord(" ")], table[ord("\n")], table[ord("A")], table[0xAD]) == ("Ġ", "Ċ", "A", "Ń")


@pytest.mark.parametrize("family", ["llada", "qwen"])
def test_chat_rendering_matches_transformers(family, folders, request):
  from transformers import PreTrainedTokenizerFast

  tok = request.getfixturevalue(family)
  source = LLADA_TEMPLATE if family == "llada" else QWEN_TEMPLATE
  assert tok.chat_template == source  # qwen: chat_template.jinja wins over the config's
  tokens = {"bos_token": "<|startoftext|>"} if family == "llada" else {}
  reference = PreTrainedTokenizerFast(
    tokenizer_file=str(folders[family] / "tokenizer.json"), eos_token="<|endoftext|>", **tokens
  )
  reference.chat_template = source
  expected = reference.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
  assert chat_template_of("", tok).render(MESSAGES) == expected


def test_a_llada_chat_prompt_has_one_bos(llada):
  rendered = chat_template_of("", llada).render(MESSAGES)
  assert rendered.startswith("<|startoftext|><|start_header_id|>system")
  prompt = prompt_ids(llada, llada.encode(rendered))
  assert prompt[0] == llada.bos_id and prompt.count(llada.bos_id) == 1
  assert prompt.count(702) == len(MESSAGES) + 1  # each <|start_header_id|> is one id
  # A config template that does not write BOS still gets one.
  plain = chat_template_of("{% for m in messages %}{{ m.content }}{% endfor %}", llada).render(MESSAGES[:1])
  assert prompt_ids(llada, llada.encode(plain))[:1] == [llada.bos_id]


def test_a_qwen_chat_prompt_has_no_bos(qwen):
  prompt = prompt_ids(qwen, qwen.encode(chat_template_of("", qwen).render(MESSAGES[1:2])))
  assert prompt[0] == 701 and qwen.eos_id not in prompt  # <|im_start|>
  assert qwen.decode(prompt).endswith("assistant\n")


def test_sentencepiece_chat_prompts_keep_their_bos(sentencepiece):
  assert chat_template_of("", sentencepiece) is None
  template = chat_template_of("{{ bos_token }}<|user|>{{ messages[0].content }}", sentencepiece)
  prompt = prompt_ids(sentencepiece, sentencepiece.encode(template.render(MESSAGES[1:2])))
  assert prompt[0] == sentencepiece.bos_id and prompt.count(sentencepiece.bos_id) == 1


def test_a_template_list_picks_the_default(tmp_path):
  entries = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": entries}))
  assert read_chat_template(tmp_path) == "D"


@pytest.mark.parametrize("family", ["llada", "qwen"])
def test_structured_output_with_the_hf_backend(family, request):
  tok = request.getfixturevalue(family)
  compiler = Compiler(tok)
  schema = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}}}
  schema["required"] = ["name", "n"]
  automaton = compiler.json_schema(schema)
  text = json.dumps({"name": "the café model", "n": 42}, separators=(",", ":"), ensure_ascii=False)
  assert automaton.accepts([*tok.encode(text), tok.eos_id])
  assert not automaton.accepts([*tok.encode('{"name":1,"n":2}'), tok.eos_id])
  assert automaton.mask_id == tok.mask_id
  special = np.flatnonzero(tok.special_mask)
  assert (automaton.table[1:][:, automaton.classes[special[special != tok.eos_id]]] < 0).all()
  regex = compiler.regex(r"def [a-z_]+\(\): return [0-9]{1,3}")
  assert regex.accepts([*tok.encode("def model_value(): return 123"), tok.eos_id])


def test_structured_output_pads_ids_past_the_tokenizer_with_the_mask_class(qwen):
  from mercury_jax.sampling import automata as device

  automaton = Compiler(qwen).regex("[a-z]+")
  tables = device.tables([automaton], device.capacity_of([automaton]), vocab=qwen.vocab_size + 8)
  assert (tables.classes[0, qwen.vocab_size :] == automaton.classes[qwen.mask_id]).all()


def test_healing_works_on_byte_level_pieces(llada):
  texts = healing.token_texts(llada)
  split = llada.encode("龘")[0]
  assert texts[split] is None and texts[llada.mask_id] is None
  allowed = healing.allowed_tokens(llada, "mod", llada.vocab_size + 4)
  assert allowed[llada.encode("model")[0]] and not allowed[llada.vocab_size :].any()
  ids = llada.encode("print(model.tok")
  kept, healed = healing.back_off(llada, "print(model.tok", ids)
  assert kept == ids[:-1] and llada.decode(kept) + healed == "print(model.tok"


def test_bytes_round_trip_picks_the_backend(llada, sentencepiece):
  again = tokenizer_from_bytes(llada.to_bytes())
  assert isinstance(again, HFTokenizer) and again.to_bytes() == llada.to_bytes()
  assert again.encode(TEXTS[2]) == llada.encode(TEXTS[2]) and again.chat_template == LLADA_TEMPLATE
  assert again.special_tokens == llada.special_tokens
  assert tokenizer_from_bytes(sentencepiece.to_bytes()).to_bytes() == sentencepiece.to_bytes()


def test_save_then_load_gives_the_same_tokenizer(qwen, tmp_path):
  qwen.save(tmp_path)
  again = HFTokenizer.load(tmp_path)
  assert again.to_bytes() == qwen.to_bytes()


def test_load_tokenizer_finds_either_backend(folders, tmp_path):
  step = tmp_path / "export" / "0" / "params"
  step.mkdir(parents=True)
  for file in ("tokenizer.json", "tokenizer_config.json", "special_tokens.json"):
    shutil.copy(folders["llada"] / file, tmp_path / "export" / file)
  assert isinstance(load_tokenizer(step), HFTokenizer)  # two folders up
  assert isinstance(load_tokenizer(tmp_path / "export"), HFTokenizer)
  shutil.copy(SENTENCEPIECE, tmp_path / "export" / "0" / "tokenizer.model")  # nearer: wins
  assert isinstance(load_tokenizer(step), Tokenizer)
  assert isinstance(load_tokenizer(SENTENCEPIECE), Tokenizer)


def test_load_tokenizer_says_what_is_missing(folders, tmp_path):
  with pytest.raises(FileNotFoundError) as missing:
    load_tokenizer(tmp_path)
  assert str(tmp_path) in str(missing.value) and "\n" not in str(missing.value)
  shutil.copy(folders["qwen"] / "tokenizer.json", tmp_path / "tokenizer.json")
  with pytest.raises(FileNotFoundError, match="no special_tokens.json; write it with"):
    load_tokenizer(tmp_path)


def test_special_tokens_file_is_strict(tmp_path):
  special = SpecialTokens(eos_id=5, pad_id=5, mask_id=9, bos_id=4, stop_ids=(7,), add_bos=True)
  path = write_special_tokens(tmp_path, special)
  data = json.loads(path.read_text())
  assert list(data) == ["bos_id", "eos_id", "pad_id", "unk_id", "mask_id", "stop_ids", "add_bos"]
  assert SpecialTokens.from_json(data) == special
  with pytest.raises(ValueError, match="unknown key 'mask'"):
    SpecialTokens.from_json({**data, "mask": 3})
  with pytest.raises(ValueError, match="lacks 'mask_id'"):
    SpecialTokens.from_json({"eos_id": 1, "pad_id": 1})
  with pytest.raises(ValueError, match="eos_id=True"):
    SpecialTokens.from_json({**data, "eos_id": True})
  with pytest.raises(ValueError, match="add_bos=true needs a bos_id"):
    SpecialTokens.from_json({**data, "bos_id": None})
