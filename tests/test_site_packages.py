"""Tests of the site-packages corpus (licences, filters, deduplication, split) and of mixing corpora with weights."""

from __future__ import annotations

import email.message
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from mercury_jax import prepare as prepare_lib
from mercury_jax.data import mixture, pipeline, records, site_packages, sources

FIXTURES = Path(__file__).parent / "fixtures"
CORPUS_GLOB = str(FIXTURES / "corpus" / "**" / "*")
TEXT_GLOB = str(FIXTURES / "corpus" / "*.txt")  # Two of CORPUS_GLOB's files.
SFT_JSONL = str(FIXTURES / "sft.jsonl")
CALC = (FIXTURES / "corpus" / "calc.py").read_text()
CODE = "def f(x):\n  return x + 1\n"


def _metadata(fields: dict[str, str | list[str]]) -> email.message.Message:
  message = email.message.Message()
  for key, value in fields.items():
    for item in [value] if isinstance(value, str) else value:
      message[key] = item
  return message


def _install(root: Path, name: str, version: str, files: dict[str, str], licence: dict[str, str | list[str]]) -> None:
  """A fake installed distribution: a ``*.dist-info`` with METADATA and a RECORD listing ``files``."""
  info = root / f"{name.replace('-', '_')}-{version}.dist-info"
  info.mkdir(parents=True)
  metadata = _metadata({"Metadata-Version": "2.4", "Name": name, "Version": version, **licence})
  (info / "METADATA").write_text(metadata.as_string())
  for rel, text in files.items():
    if text is not None:
      (root / rel).parent.mkdir(parents=True, exist_ok=True)
      (root / rel).write_text(text, encoding="utf-8")
  listed = [*files, f"{info.name}/METADATA", f"{info.name}/RECORD"]
  (info / "RECORD").write_text("".join(f"{rel},,\n" for rel in listed))


@pytest.fixture
def site(tmp_path, monkeypatch) -> Path:
  """A fake site-packages that the default loader reads instead of the interpreter's."""
  root = tmp_path / "site-packages"
  files = {
    "pkg/__init__.py": "",  # Empty: skipped.
    "pkg/core.py": CODE,
    "pkg/testing/helpers.py": "def helper():\n  pass\n",  # `testing` is library code (numpy.testing): kept.
    "pkg/tests/test_core.py": CODE + "# a\n",
    "pkg/test/support.py": CODE + "# b\n",
    "pkg/core_test.py": CODE + "# c\n",
    "pkg/test_cli.py": CODE + "# d\n",
    "pkg/conftest.py": CODE + "# e\n",
    "pkg/_vendor/six.py": CODE + "# f\n",
    "pkg/vendored/lib.py": CODE + "# g\n",
    "pkg/third_party/lib.py": CODE + "# h\n",
    "pkg/accents.py": "s = 'caf\u00e9'\n",
    "pkg/broken.py": "def f(:\n",
    "pkg/big.py": "x = 1\n" * 40_000,
    "pkg/core.pyi": "def f(x: int) -> int: ...\n",
    "pkg/data.json": "{}\n",
    "pkg/gone.py": None,  # Listed in RECORD, not on disk: skipped.
    "../bin/tool.py": CODE + "# i\n",  # Outside site-packages.
    "__editable___pkg_finder.py": CODE + "# j\n",
  }
  _install(root, "Fancy_Pkg", "1.0", files, {"License-Expression": "MIT OR GPL-2.0-only"})
  _install(root, "copier", "2.0", {"aaa/core_copy.py": CODE, "aaa/calc.py": CALC}, {"License": "BSD License"})
  _install(root, "gplpkg", "3.0", {"gplpkg/mod.py": CODE + "# k\n"}, {"License": "GPL-3.0-or-later"})
  _install(root, "mystery", "0.1", {"mystery/mod.py": CODE + "# l\n"}, {"License": "Custom terms"})
  monkeypatch.syspath_prepend(str(root))
  monkeypatch.setattr(site_packages, "_site_roots", lambda: [root.resolve()])
  return root


def _sha1_split(key: str) -> str:
  return "validation" if int(hashlib.sha1(key.encode()).hexdigest(), 16) % 20 == 0 else "train"


# ----------------------------------------------------------------------------------------------- licences


@pytest.mark.parametrize(
  "fields, expression, permissive, field",
  [
    ({"License-Expression": "MIT OR GPL-3.0-only"}, "MIT OR GPL-3.0-only", True, "License-Expression"),
    ({"License-Expression": "MIT AND GPL-3.0-only"}, "MIT AND GPL-3.0-only", False, "License-Expression"),
    ({"License-Expression": "Apache-2.0 AND (MIT OR GPL-2.0+)"}, "Apache-2.0 AND (MIT OR GPL-2.0+)", True, None),
    ({"License-Expression": "(GPL-2.0-only OR LGPL-3.0) and mit"}, "(GPL-2.0-only OR LGPL-3.0) AND MIT", False, None),
    ({"License-Expression": "apache-2.0 WITH LLVM-exception"}, "Apache-2.0 WITH LLVM-exception", True, None),
    ({"License-Expression": "bsd-3-clause AND 0BSD AND CC0-1.0"}, "BSD-3-Clause AND 0BSD AND CC0-1.0", True, None),
    ({"License-Expression": "GPL-3.0-only", "License": "MIT"}, "GPL-3.0-only", False, "License-Expression"),
    ({"License-Expression": "MIT OR", "License": "MIT"}, "", False, "License-Expression"),
    ({"License": "Apache 2.0"}, "Apache-2.0", True, "License"),
    ({"License": "3-Clause BSD License"}, "BSD-3-Clause", True, "License"),
    ({"License": "The MIT License (MIT)"}, "MIT", True, "License"),
    ({"License": "MIT OR AFL-2.1"}, "MIT OR AFL-2.1", True, "License"),
    ({"License": "GPL"}, "GPL", False, "License"),
    (
      {"License": "BSD 3-Clause License\n\nCopyright (c) 2021, Someone\nAll rights reserved.\n"},
      "BSD-3-Clause",
      True,
      None,
    ),
    (
      {"License": "Apache License\n  Version 2.0, January 2004\n  http://www.apache.org/licenses/\n"},
      "Apache-2.0",
      True,
      None,
    ),
    (
      {
        "License": "Copyright (c) 2001, Enthought\nAll rights reserved.",
        "Classifier": "License :: OSI Approved :: BSD License",
      },
      "BSD",
      True,
      "Classifier",
    ),
    ({"License": "UNKNOWN", "Classifier": "License :: OSI Approved :: MIT License"}, "MIT", True, "Classifier"),
    (
      {"Classifier": ["License :: OSI Approved :: MIT License", "License :: OSI Approved :: Apache Software License"]},
      "MIT AND Apache-2.0",
      True,
      "Classifier",
    ),
    (
      {
        "Classifier": [
          "License :: OSI Approved :: MIT License",
          "License :: OSI Approved :: GNU General Public License v3 (GPLv3)",
        ]
      },
      "MIT AND GNU General Public License v3 (GPLv3)",
      False,
      "Classifier",
    ),
    ({"Classifier": "License :: OSI Approved :: Python Software Foundation License"}, "PSF-2.0", True, "Classifier"),
    ({"Classifier": ["License :: OSI Approved", "License :: OSI Approved :: ISC License (ISCL)"]}, "ISC", True, None),
    ({"Classifier": ["License :: OSI Approved", "Programming Language :: Python"]}, "", False, ""),
    ({"License": "Proprietary, all rights reserved"}, "", False, "License"),
    ({"License": "Proprietary (MIT)"}, "", False, "License"),
    ({}, "", False, ""),
  ],
)
def test_read_license(fields, expression, permissive, field):
  lic = site_packages.read_license(_metadata(fields))
  assert (lic.expression, lic.permissive) == (expression, permissive)
  if field is not None:
    assert lic.field == field


def test_normalize_name_follows_pep_503():
  assert site_packages.normalize_name("Friendly-Bard") == "friendly-bard"
  assert site_packages.normalize_name("FRIENDLY._-bard") == "friendly-bard"
  assert site_packages.normalize_name("orbax_checkpoint") == "orbax-checkpoint"


# ----------------------------------------------------------------------------------------------- the corpus


def test_every_permissive_distribution_filtered_and_deduplicated(site):
  result = sources.load_corpus("site-packages")
  assert result.kind == "site-packages" and result.mode == "lm"
  # aaa/core_copy.py (copier) and pkg/core.py (fancy-pkg) are one text: the first in key order is kept.
  assert [d.key for d in result.documents] == ["aaa/calc.py", "aaa/core_copy.py", "pkg/testing/helpers.py"]
  manifest = result.manifest()
  assert manifest["python_version"]
  assert [(d["name"], d["version"], d["license"], d["files"]) for d in manifest["distributions"]] == [
    ("copier", "2.0", "BSD", 2),
    ("fancy-pkg", "1.0", "MIT OR GPL-2.0-only", 1),
  ]
  assert [(s["name"], s["license"], s["license_text"]) for s in manifest["skipped_distributions"]] == [
    ("gplpkg", "GPL-3.0-or-later", "GPL-3.0-or-later"),
    ("mystery", "", "Custom terms"),
  ]
  assert manifest["duplicates"] == [
    {
      "sha256": hashlib.sha256(CODE.encode()).hexdigest(),
      "corpus": "site-packages",
      "key": "pkg/core.py",
      "kept_corpus": "site-packages",
      "kept_key": "aaa/core_copy.py",
    }
  ]
  files = {f["path"]: f for f in manifest["files"]}
  assert set(files) == {"aaa/calc.py", "aaa/core_copy.py", "pkg/core.py", "pkg/testing/helpers.py"}
  assert files["pkg/core.py"] == {
    "path": "pkg/core.py",
    "sha256": hashlib.sha256(CODE.encode()).hexdigest(),
    "characters": len(CODE),
    "documents": 0,  # The dropped copy.
    "distribution": "fancy-pkg",
    "version": "1.0",
    "license": "MIT OR GPL-2.0-only",
  }
  assert files["aaa/core_copy.py"]["documents"] == 1 and files["aaa/core_copy.py"]["distribution"] == "copier"


def test_explicit_names_are_normalised_and_read_alone(site):
  result = sources.load_corpus("site-packages:FANCY.pkg")
  assert [d.key for d in result.documents] == ["pkg/core.py", "pkg/testing/helpers.py"]
  assert result.manifest()["duplicates"] == []


@pytest.mark.parametrize(
  "spec, message",
  [
    (
      "site-packages:fancy-pkg,nosuchdist",
      "--corpus 'site-packages:fancy-pkg,nosuchdist': no distribution 'nosuchdist'",
    ),
    ("site-packages:gplpkg", "gplpkg 3.0 has 'GPL-3.0-or-later' (License), which is not permissive"),
    ("site-packages:mystery", "mystery 0.1 has no readable licence (License: 'Custom terms'), which is not permissive"),
    ("site-packages:", "must be site-packages or site-packages:NAME[,NAME...]"),
    ("site-packages:a,,b", "must be site-packages or site-packages:NAME[,NAME...]"),
  ],
)
def test_explicit_names_must_be_installed_and_permissive(site, spec, message):
  with pytest.raises(ValueError) as info:
    sources.load_corpus(spec)
  assert message in str(info.value) and "\n" not in str(info.value)


def test_split_is_a_hash_of_the_path_in_site_packages_on_any_machine(tmp_path):
  files = {f"mod/m{i:02d}.py": f"x = {i}\n" for i in range(60)}
  splits = []
  for machine in ("a", "b/deeper"):
    _install(tmp_path / machine, "mod", "1.0", files, {"License-Expression": "ISC"})
    result = site_packages.site_packages_corpus("site-packages:mod", path=[tmp_path / machine])
    splits.append([(d.key, d.split) for d in result.documents])
  assert splits[0] == splits[1] and [k for k, _ in splits[0]] == sorted(files)
  assert all(split == _sha1_split(key) for key, split in splits[0])
  assert 0 < sum(split == "validation" for _, split in splits[0]) < 10


# ----------------------------------------------------------------------------------------------- mixtures


@pytest.mark.parametrize(
  "spec, expected", [("python-stdlib", ("python-stdlib", 1)), ("a@3", ("a", 3)), ("x@y/*.txt", ("x@y/*.txt", 1))]
)
def test_parse_weight(spec, expected):
  assert mixture.parse_weight(spec) == expected


def test_mixture_deduplicates_across_corpora_in_the_order_given(site):
  mixed = sources.load_mixture([CORPUS_GLOB, "site-packages:copier@2"])
  text, packages = (p.corpus for p in mixed.parts)
  assert [d.key for d in text.documents] == [d.key for d in sources.load_corpus(CORPUS_GLOB).documents]
  assert [d.key for d in packages.documents] == ["aaa/core_copy.py"]  # aaa/calc.py is the glob's calc.py.
  assert mixed.duplicates == (
    {
      "sha256": hashlib.sha256(CALC.encode()).hexdigest(),
      "corpus": "site-packages:copier@2",
      "key": "aaa/calc.py",
      "kept_corpus": CORPUS_GLOB,
      "kept_key": "calc.py",
    },
  )
  manifest = mixed.manifest()
  assert manifest["kind"] == "mixture" and manifest["duplicates"] == list(mixed.duplicates)
  assert [(c["spec"], c["weight"], c["kind"], c["root"]) for c in manifest["corpora"]] == [
    (CORPUS_GLOB, 1, "text", "corpus"),  # Roots are cut to their names: no machine's paths.
    ("site-packages:copier@2", 2, "site-packages", "site-packages"),
  ]
  reversed_order = sources.load_mixture(["site-packages:copier", CORPUS_GLOB])
  assert reversed_order.duplicates[0]["key"] == "calc.py" and reversed_order.duplicates[0]["kept_key"] == "aaa/calc.py"


def _stream_texts(data_dir: Path, split: str, tokenizer) -> list[str]:
  meta = pipeline.read_metadata(data_dir)["splits"][split]
  tokens = records.read_shards([data_dir / name for name in meta["shards"]])[:, 0].reshape(-1)[: meta["target_tokens"]]
  pieces = np.split(tokens, np.nonzero(tokens == tokenizer.eos_id)[0] + 1)[:-1]
  return [tokenizer.decode(p) for p in pieces]


def test_weights_repeat_train_documents_only(tmp_path):
  quiet = {"vocab_size": 400, "seq_len": 32, "num_shards": 2, "log": lambda _: None}
  prepare_lib.prepare(CORPUS_GLOB, tmp_path / "once", **quiet)
  specs = [f"{TEXT_GLOB}@3", f"{CORPUS_GLOB}@2"]
  metadata = prepare_lib.prepare(
    specs, tmp_path / "mix", tokenizer_path=str(tmp_path / "once" / "tokenizer.model"), **quiet
  )
  texts = sources.load_corpus(TEXT_GLOB)
  rest = [d for d in sources.load_corpus(CORPUS_GLOB).documents if not d.key.endswith(".txt")]  # .txt: duplicates.
  train = [[d.text for d in texts.split("train")], [d.text for d in rest if d.split == "train"]]
  assert all(train)
  tokenizer = pipeline.load_data_tokenizer(tmp_path / "mix")
  # Pass r holds the train documents of each corpus whose weight exceeds r: weights (3, 2) pack A B, A B, A.
  assert _stream_texts(tmp_path / "mix", "train", tokenizer) == train[0] + train[1] + train[0] + train[1] + train[0]
  validation = [d.text for d in texts.split("validation")] + [d.text for d in rest if d.split == "validation"]
  assert validation and _stream_texts(tmp_path / "mix", "validation", tokenizer) == validation
  parts = metadata["corpora"]
  assert [(p["weight"], p["splits"]["train"]["documents"]) for p in parts] == [
    (3, 3 * len(train[0])),
    (2, 2 * len(train[1])),
  ]
  for split in ("train", "validation"):
    for key in ("documents", "characters", "target_tokens"):
      assert sum(p["splits"][split][key] for p in parts) == metadata["splits"][split][key]
  assert metadata["corpus"] == specs
  assert [
    d.text for d in sources.load_corpus(metadata["corpus"]).split("validation")
  ] == validation  # As bench reads it.
  manifest = json.loads((tmp_path / "mix" / "manifest.json").read_text())
  assert manifest["splits"]["train"]["documents"] == metadata["splits"]["train"]["documents"]
  assert [(d["key"], d["kept_key"]) for d in manifest["duplicates"]] == [
    ("notes.txt", "notes.txt"),
    ("poem.txt", "poem.txt"),
  ]


def test_one_corpus_as_a_list_or_weighted_1_writes_the_same_bytes(tmp_path):
  quiet = {"vocab_size": 400, "seq_len": 32, "num_shards": 2, "log": lambda _: None}
  for name, spec in (("plain", SFT_JSONL), ("list", [SFT_JSONL]), ("weighted", [f"{SFT_JSONL}@1"])):
    prepare_lib.prepare(spec, tmp_path / name, **{**quiet, "seq_len": 64})
  written = sorted((tmp_path / "plain").iterdir())
  assert {"manifest.json", "metadata.json", "tokenizer.model"} < {p.name for p in written}
  for name in ("list", "weighted"):
    for path in written:
      assert (tmp_path / name / path.name).read_bytes() == path.read_bytes(), (name, path.name)


def test_prepare_site_packages_end_to_end(site, tmp_path):
  lines = []
  metadata = prepare_lib.prepare(
    ["python-stdlib", "site-packages:fancy-pkg,copier"], tmp_path / "out", vocab_size=512, seq_len=64, log=lines.append
  )
  manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
  packages = manifest["corpora"][1]
  assert {f["path"] for f in packages["files"] if f["documents"]} == {
    "aaa/calc.py",
    "aaa/core_copy.py",
    "pkg/testing/helpers.py",
  }
  assert metadata["python_version"] == manifest["python_version"]
  assert [p["spec"] for p in metadata["corpora"]] == ["python-stdlib", "site-packages:fancy-pkg,copier"]
  # The summary gives documents, characters and target tokens per corpus and split.
  assert any(line.startswith("    site-packages:fancy-pkg,copier: ") and "target tokens" in line for line in lines)
  assert sum(line.startswith("    python-stdlib: ") for line in lines) == 2


# ----------------------------------------------------------------------------------------------- CLI errors


@pytest.mark.parametrize(
  "corpora, expected",
  [
    (["site-packages:nosuchdist-xyz"], "no distribution 'nosuchdist-xyz' is installed"),
    (["site-packages:gplpkg"], "gplpkg 3.0 has 'GPL-3.0-or-later' (License), which is not permissive"),
    (["python-stdlib@0"], "weight '0' must be an integer >= 1"),
    (["python-stdlib", "site-packages@1.5"], "weight '1.5' must be an integer >= 1"),
    (["python-stdlib@two"], "weight 'two' must be an integer >= 1"),
    (["python-stdlib", "python-stdlib@2"], "is given twice"),
    ([CORPUS_GLOB, SFT_JSONL], "is 'sft' but --corpus"),
  ],
)
def test_cli_errors_are_one_line_with_exit_code_2(site, tmp_path, capsys, corpora, expected):
  argv = [arg for spec in corpora for arg in ("--corpus", spec)]
  code = prepare_lib.main([*argv, "--out", str(tmp_path / "out"), "--vocab-size", "400"])
  lines = capsys.readouterr().err.strip().splitlines()
  err = [line for line in lines if not line.startswith("mercury_jax.prepare: ")]  # the stage it got to (progress)
  assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and expected in err[0], lines
  assert not (tmp_path / "out").exists()
