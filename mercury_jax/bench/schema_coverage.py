"""JSON Schema coverage of structured output (docs/schema_coverage.md): the official test suite and JSONSchemaBench's
collections.

    python -m mercury_jax.bench schema-suite [--samples 8] [--out docs/bench/schema]
    python -m mercury_jax.bench schema-bench --data JSONSCHEMABENCH/data [--tests JSONSCHEMABENCH/maskbench/data]
        [--per 100] [--samples 8] [--out ...]
    python -m mercury_jax.bench schema-vendor --sdist jsonschema-4.26.0.tar.gz

``schema-suite``: every schema of drafts 2020-12 and 7 of the JSON-Schema-Test-Suite vendored in
``tests/fixtures/json_schema_test_suite`` (format tests, and schemas that need another document or a dynamic
scope, left out), compiled as a library user would (``Compiler(tokenizer)``, the bundled tokenizer), once with the
default draft (``"auto"``) and once with the suite's draft named. For each accepted schema: ``--samples`` random
texts of the automaton must validate (``jsonschema``, numbers as ``Decimal``) and every number in them be readable
(a finite double, zero only when written as zero); every invalid instance of the suite must be rejected by the
automaton's texts (compact, in its own key order and in the schema's); the valid ones, written as the compiler writes
(the schema's key order, compact), are counted when accepted.

``schema-bench``: ``--per`` schemas of each collection of JSONSchemaBench (arXiv 2501.10868), drawn with a fixed
seed from the sorted file names. The collections are not vendored (their files carry no licence): clone
``https://github.com/guidance-ai/jsonschemabench`` and pass its ``data`` directory. The same sampling checks, and the
refusals by reason. With ``--tests``, the instances JSONSchemaBench's ``maskbench/data`` gives for the same schema
(``<collection>---<file>``, where the schema there is the same) are checked as the suite's are: each is labelled valid
or invalid by the same validator as the samples (the labels they carry, from other validators, are counted where
they differ), every invalid one must be rejected and the valid ones are counted when accepted.

Each compile may take 30 s of CPU time (``ITIMER_PROF``: on a shared machine, wall time measures the neighbours
too; both are recorded, the distributions are of CPU seconds); its peak memory is the process's resident high-water
mark (reset before each compile through ``/proc/self/clear_refs``) above what it held before. Results go to
``OUT/suite.json`` or ``OUT/bench.json`` (the command, the machine, and one record per schema) and a markdown
summary on stdout.

``schema-vendor``: writes the suite's files of drafts 2020-12 and 7 (but ``format.json``) from ``jsonschema``'s source
distribution into ``tests/fixtures/json_schema_test_suite/suite.json``, with its licence.
"""

from __future__ import annotations

import argparse
import collections
import decimal
import json
import random
import signal
import statistics
import sys
import tarfile
import time
import warnings
from pathlib import Path

from mercury_jax.bench.throughput import host_info
from mercury_jax.constrain import Compiler, ConstraintError, conformance
from mercury_jax.data.tokenizer import load_tokenizer
from mercury_jax.files import TOKENIZER_FILE
from mercury_jax.sampling.registry import DEFAULT_CHECKPOINT

TOKENIZER = DEFAULT_CHECKPOINT / TOKENIZER_FILE  # the bundled model's, as a library user gets it
COLLECTIONS = (
  "Github_trivial",
  "Github_easy",
  "Github_medium",
  "Github_hard",
  "Github_ultra",
  "Glaiveai2K",
  "JsonSchemaStore",
  "Kubernetes",
  "Snowplow",
  "WashingtonPost",
)
TIME_LIMIT = 30  # CPU seconds a compile may take


def _peak_reset() -> int:
  Path("/proc/self/clear_refs").write_text("5")
  return _rss("VmRSS")


def _rss(field: str) -> int:
  for line in Path("/proc/self/status").read_text().splitlines():
    if line.startswith(field + ":"):
      return int(line.split()[1]) * 1024
  return 0


class _Timeout(Exception):
  pass


def _alarm(signum, frame):
  raise _Timeout


def measure(compiler: Compiler, tokenizer, schema, draft: str | None, samples: int, *, valid=(), invalid=()) -> dict:
  """One schema: compiled (time, memory, size) and checked (conformance.check), or refused (the reason)."""
  out: dict = {}
  before = _peak_reset()
  start, cpu = time.perf_counter(), time.process_time()
  signal.setitimer(signal.ITIMER_PROF, TIME_LIMIT)
  try:
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      automaton = compiler.json_schema(schema)
  except ConstraintError as e:
    out.update(refused=str(e), param=e.param)
    return out
  except _Timeout:
    out.update(refused=f"timeout ({TIME_LIMIT} CPU seconds)")
    return out
  except Exception as e:  # noqa: BLE001  a crash is a result to report
    out.update(crashed=f"{type(e).__name__}: {e}")
    return out
  finally:
    signal.setitimer(signal.ITIMER_PROF, 0)
    out["seconds"] = time.process_time() - cpu
    out["wall_seconds"] = time.perf_counter() - start
    out["memory"] = max(_rss("VmHWM") - before, 0)
  out.update(states=automaton.num_states, classes=automaton.num_classes, edges=automaton.num_edges)
  out["warnings"] = [str(w.message) for w in caught]
  read = draft or compiler.options.draft
  try:
    report = conformance.check(automaton, tokenizer, schema, read, valid, invalid, samples=samples)
  except Exception as e:  # noqa: BLE001
    out["check_failed"] = f"{type(e).__name__}: {e}"
    return out
  out.update(
    samples=report.samples,
    invalid_samples=report.invalid_samples[:3],
    unreadable=report.unreadable[:3],
    invalid_accepted=report.invalid_accepted[:3],
    valid_accepted=report.valid_accepted,
    valid_total=report.valid_total,
    invalid_total=len(invalid),
  )
  return out


def _distribution(values: list[float]) -> str:
  if not values:
    return "-"
  values = sorted(values)
  p95 = values[min(len(values) - 1, round(0.95 * (len(values) - 1)))]
  return f"{statistics.median(values):.3g} / {p95:.3g} / {values[-1]:.3g}"


NARROWED = "written as a subset"  # the warning line's phrase for narrowing (constrain.keywords.report)


def _summary(title: str, rows: list[dict]) -> list[str]:
  accepted = [r for r in rows if "states" in r]
  lines = [f"### {title}", ""]
  lines.append(f"- schemas: {len(rows)}; accepted: {len(accepted)} ({100 * len(accepted) / max(len(rows), 1):.1f} %)")
  narrowed = sum(any(NARROWED in w for w in r.get("warnings", ())) for r in accepted)
  lines.append(
    f"- of those, written as a subset of what the schema allows (narrowed, named in the warning): {narrowed}"
  )
  lines.append(f"- crashed: {sum('crashed' in r or 'check_failed' in r for r in rows)}")
  samples = sum(r.get("samples", 0) for r in accepted)
  lines.append(
    f"- sampled outputs: {samples}; invalid: {sum(len(r.get('invalid_samples', [])) for r in accepted)}; "
    f"unreadable numbers: {sum(len(r.get('unreadable', [])) for r in accepted)}"
  )
  if any(r.get("valid_total") or r.get("invalid_total") for r in accepted):
    lines.append(
      f"- instances of accepted schemas: {sum(r.get('invalid_total', 0) for r in accepted)} invalid, texts of them "
      f"accepted: {sum(len(r.get('invalid_accepted', ())) for r in accepted)}; valid ones accepted: "
      f"{sum(r.get('valid_accepted', 0) for r in accepted)} of {sum(r.get('valid_total', 0) for r in accepted)}"
    )
  if any(r.get("relabelled") for r in rows):
    lines.append(f"- instances whose maskbench label the validator here reverses: {sum(r['relabelled'] for r in rows)}")
  lines.append(f"- compile CPU seconds (median / p95 / max): {_distribution([r['seconds'] for r in accepted])}")
  lines.append(f"- compile wall seconds (median / p95 / max): {_distribution([r['wall_seconds'] for r in accepted])}")
  every = [r["seconds"] for r in rows if "seconds" in r]
  lines.append(f"- CPU seconds of every compile, refusals too (median / p95 / max): {_distribution(every)}")
  lines.append(f"- compile MiB (median / p95 / max): {_distribution([r['memory'] / 2**20 for r in accepted])}")
  lines.append(f"- states (median / p95 / max): {_distribution([r['states'] for r in accepted])}")
  lines.append(f"- token classes (median / p95 / max): {_distribution([r['classes'] for r in accepted])}")
  lines.append(f"- edges (median / p95 / max): {_distribution([r['edges'] for r in accepted])}")
  reasons = collections.Counter(r["refused"].split(";")[0][:100] for r in rows if "refused" in r)
  if reasons:
    lines.append("- refusals:")
    lines += [f"  - {n} x {reason}" for reason, n in reasons.most_common(15)]
  return lines + [""]


def suite(args: argparse.Namespace) -> None:
  tokenizer = load_tokenizer(TOKENIZER)
  cases = conformance.official_suite()
  rows = []
  for name in ("auto", "named"):
    compilers = {
      d: Compiler(tokenizer, **({} if name == "auto" else {"draft": v})) for d, v in conformance.DRAFTS.items()
    }
    for case in cases:
      start = time.perf_counter()
      draft = conformance.DRAFTS[case.draft] if name == "named" else None
      row = {"case": case.name, "draft": case.draft, "default": name}
      samples = args.samples if name == "named" else 0
      valid, invalid = (case.valid, case.invalid) if name == "named" else ((), ())
      row.update(measure(compilers[case.draft], tokenizer, case.schema, draft, samples, valid=valid, invalid=invalid))
      row["wall"] = time.perf_counter() - start
      rows.append(row)
  _write(args, "suite.json", rows)
  lines = []
  for name in ("named", "auto"):
    for draft in conformance.DRAFTS:
      part = [r for r in rows if r["draft"] == draft and r["default"] == name]
      lines += _summary(f"{draft}, draft {'named' if name == 'named' else 'auto (no $schema)'}", part)
  print("\n".join(lines))


def _instances(folder: str | None, collection: str, name: str, schema) -> tuple[list, list, int]:
  """``(valid, invalid, relabelled)``: maskbench's instances of the schema (module docstring), labelled by the
  validator the samples are checked with; ``relabelled``: how many carried the other label."""
  path = Path(folder or "") / f"{collection}---{name}"
  if folder is None or not path.exists():
    return [], [], 0
  found = json.loads(path.read_text())
  if found.get("schema") != schema:
    return [], [], 0
  try:
    check = conformance.validator(schema, "auto")
  except Exception:  # noqa: BLE001  a schema the validator cannot read: no instances
    return [], [], 0
  valid, invalid, relabelled = [], [], 0
  for test in found.get("tests", []):
    exact = json.loads(json.dumps(test["data"]), parse_float=decimal.Decimal)
    try:
      ok = not conformance.errors(check, exact)
    except Exception:  # noqa: BLE001
      continue
    (valid if ok else invalid).append(test["data"])
    relabelled += ok != bool(test.get("valid"))
  return valid, invalid, relabelled


def bench(args: argparse.Namespace) -> None:
  tokenizer = load_tokenizer(TOKENIZER)
  compiler = Compiler(tokenizer)
  rows = []
  lines = []
  for collection in args.collections:
    files = sorted((Path(args.data) / collection).glob("*.json"))
    chosen = random.Random(args.seed).sample(files, min(args.per, len(files)))
    part = []
    for path in chosen:
      start = time.perf_counter()
      row = {"collection": collection, "file": path.name}
      schema = json.loads(path.read_text())
      valid, invalid, row["relabelled"] = _instances(args.tests, collection, path.name, schema)
      row.update(measure(compiler, tokenizer, schema, None, args.samples, valid=valid, invalid=invalid))
      row["wall"] = time.perf_counter() - start
      part.append(row)
      said = row.get("check_failed", "ok") if "states" in row else row.get("refused", row.get("crashed"))
      print(collection, path.name, said, file=sys.stderr)
    rows += part
    lines += _summary(collection, part)
    _write(args, "bench.json", rows)  # after each collection: a long run leaves what it has measured
  lines += _summary("all collections", rows)
  print("\n".join(lines))


def vendor(args: argparse.Namespace) -> None:
  out = {"source": "JSON-Schema-Test-Suite, as vendored in jsonschema's source distribution (json/tests)", "files": {}}
  with tarfile.open(args.sdist) as sdist:
    names = sorted(n for n in sdist.getnames() if "/json/tests/" in n and n.endswith(".json"))
    for name in names:
      draft, file = name.split("/")[-2:]
      if draft in conformance.DRAFTS and file != "format.json":
        out["files"][f"{draft}/{file}"] = json.load(sdist.extractfile(name))
    licence = next(n for n in sdist.getnames() if n.endswith("/json/LICENSE"))
    folder = conformance.SUITE_FILE.parent
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "LICENSE").write_bytes(sdist.extractfile(licence).read())
  conformance.SUITE_FILE.write_text(json.dumps(out, separators=(",", ":"), ensure_ascii=False) + "\n")


def _write(args, name: str, rows: list[dict]) -> None:
  folder = Path(args.out)
  folder.mkdir(parents=True, exist_ok=True)
  record = {"command": "python -m mercury_jax.bench " + " ".join(sys.argv[1:]), "machine": host_info(), "rows": rows}
  (folder / name).write_text(json.dumps(record, indent=1, default=str) + "\n")


def _add_common(p: argparse.ArgumentParser) -> None:
  p.add_argument("--samples", type=int, default=8, help="random texts checked per accepted schema")
  p.add_argument("--out", default="docs/bench/schema", help="folder for suite.json or bench.json")


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
  _add_common(p)
  p.add_argument("--data", required=True, help="JSONSchemaBench's data folder (a clone of guidance-ai/jsonschemabench)")
  p.add_argument("--tests", default=None, help="JSONSchemaBench's maskbench/data folder: instances of the schemas")
  p.add_argument("--per", type=int, default=100, help="schemas drawn from each collection")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--collections", nargs="+", default=list(COLLECTIONS))


def add_vendor_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument("--sdist", required=True, help="jsonschema's source distribution (.tar.gz)")


def run_suite(args: argparse.Namespace) -> None:
  """The official JSON Schema test suite: schemas accepted, outputs valid, invalid instances rejected.

  Drafts 2020-12 and 7, each with the draft named and without $schema; sampled texts must validate and every invalid
  instance be rejected.
  """
  signal.signal(signal.SIGPROF, _alarm)
  suite(args)


def run_bench(args: argparse.Namespace) -> None:
  """JSONSchemaBench's real-world schemas: accepted per collection, outputs valid, refusals by reason.

  --per schemas of each collection (fixed seed); with --tests, maskbench's instances of each are checked too.
  """
  signal.signal(signal.SIGPROF, _alarm)
  bench(args)


def run_vendor(args: argparse.Namespace) -> None:
  """Vendors the official test suite (drafts 2020-12 and 7) from jsonschema's sdist into tests/fixtures."""
  vendor(args)


COMMANDS = {
  "schema-suite": (_add_common, run_suite),
  "schema-bench": (add_bench_arguments, run_bench),
  "schema-vendor": (add_vendor_arguments, run_vendor),
}
