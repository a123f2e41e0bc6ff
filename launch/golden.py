"""Golden tokens: every decode path's output for a fixed set of seeded requests, recorded once and checked after a
refactor (the engine's redesign must change no token).

  python launch/golden.py record --out docs/bench/golden/tokens.json     # before the change
  python launch/golden.py check --golden docs/bench/golden/tokens.json   # after it: every token bitwise the same

The cases cover every decode mode, cache, step rule, structured output, token healing, templates, streaming, a
sharded mesh and the HTTP server, on the bundled models and on small random-weight checkpoints of every kind (made
afresh from a fixed key, so the same weights every run). The tokens are exact integers, but a sampled token can
flip where two logits round differently on another CPU: record and check on the same machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from mercury_jax import sharding as sh  # noqa: E402
from mercury_jax.checkpoint import export_params  # noqa: E402
from mercury_jax.config import Config, MeshConfig, ModelConfig, ObjectiveConfig  # noqa: E402
from mercury_jax.model import Transformer  # noqa: E402
from mercury_jax.sampling.registry import default_checkpoint  # noqa: E402
from mercury_jax.sampling.sampler import Sampler  # noqa: E402

RANDOM = {  # kind: (causal, objective, extra model fields)
  "block_diffusion": (False, ObjectiveConfig(block_size=4), {}),
  "autoregressive": (True, ObjectiveConfig(name="autoregressive"), {}),
  "whole_sequence": (False, ObjectiveConfig(), {}),
  "shifted": (False, ObjectiveConfig(block_size=4), {"shifted_logits": True}),
  "verified": (False, ObjectiveConfig(name="verified", draft_length=4), {}),
  "continuous_block": (False, ObjectiveConfig(name="continuous", block_size=4, self_conditioning=0.5), {}),
  "continuous": (False, ObjectiveConfig(name="continuous", self_conditioning=0.5), {}),
}
PROMPTS = ["def fibonacci(n):", "import os\n\nclass Config:", "    return"]
SCHEMA = {
  "type": "object",
  "properties": {"name": {"type": "string", "maxLength": 8}, "size": {"type": "integer"}},
  "required": ["name", "size"],
}
REGEX = r"(yes|no), [0-9]{2}"
TEMPLATE = "def add(a, b):\n    <mask:12>\n\n<mask:8>"


def random_checkpoint(root: Path, kind: str, tokenizer: Path) -> Path:
  causal, objective, extra = RANDOM[kind]
  model = ModelConfig(
    vocab_size=4096, d_model=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64, max_length=128,
    causal=causal, latent_dim=16 if objective.continuous else 0, **extra,
  )  # fmt: skip
  params = nn.meta.unbox(Transformer(model).init(jax.random.key(1), jnp.zeros((1, 8), jnp.int32)))["params"]
  params = jax.tree.map(lambda p: p * 8.0, params)
  return export_params(root / kind, params, Config(model=model, objective=objective, name=kind), tokenizer).parent


def library_cases(name: str, objective: ObjectiveConfig) -> list[tuple[str, dict]]:
  """``(label, generate kwargs)`` of one model."""
  base = dict(prompts=PROMPTS, length=24, seed=3)
  cases = [("greedy", dict(base, temperature=0.0)), ("sampled", dict(base, temperature=1.0, num_samples=2))]
  cases.append(("top_k_top_p", dict(base, temperature=0.8, top_k=20, top_p=0.9)))
  cases.append(("min_length", dict(base, temperature=1.0, min_length=10)))
  continuous = objective.name == "continuous"
  verified = objective.name == "verified"
  autoregressive = objective.name == "autoregressive"
  if continuous:
    cases.append(("heun", dict(base, temperature=1.0, solver="heun")))
    if objective.block_size:
      cases.append(("guided", dict(base, temperature=1.0, guidance=2.0)))
    cases.append(("trace", dict(base, prompts=PROMPTS[:1], show_steps=True, temperature=1.0)))
    if objective.block_size:
      cases.append(("regex", dict(base, temperature=1.0, constraint="regex")))
    return cases
  if not autoregressive and not verified:
    for rule in ("confidence", "ancestral"):
      cases.append((rule, dict(base, temperature=1.0, rule=rule, steps=12)))
    cases.append(("revision", dict(base, temperature=1.0, rule="confidence", revision=0.3, steps=16)))
    cases.append(("margin", dict(base, temperature=1.0, confidence="margin", threshold=0.5)))
    cases.append(("timesteps", dict(base, temperature=1.0, rule="confidence", commit_counts="timesteps", steps=16)))
  if objective.block_size or autoregressive:
    cases.append(("no_cache", dict(base, temperature=1.0, cache="none")))
  if not objective.block_size and not autoregressive and not verified:
    cases.append(("dual", dict(base, temperature=1.0, cache="dual", block_length=8)))
    cases.append(("prefix", dict(base, temperature=1.0, cache="prefix", block_length=8)))
    cases.append(("semi_ar", dict(base, temperature=1.0, block_length=8)))
  if verified:
    cases.append(("ar_mode", dict(base, temperature=1.0, decode="ar")))
    cases.append(("diffusion_mode", dict(base, temperature=1.0, decode="diffusion")))
    cases.append(("draft3", dict(base, temperature=1.0, draft_length=3)))
  cases.append(("template", dict(base, prompts=None, template=TEMPLATE, temperature=1.0)))
  cases.append(("healing", dict(base, prompts=["def fibon", "    retur"], temperature=1.0)))
  cases.append(("regex", dict(base, temperature=1.0, constraint="regex")))
  cases.append(("schema", dict(base, length=40, temperature=1.0, constraint="schema")))
  cases.append(("schema_greedy", dict(base, length=40, temperature=0.0, constraint="schema")))
  cases.append(("trace", dict(base, prompts=PROMPTS[:1], show_steps=True, temperature=1.0)))
  cases.append(("stream", dict(base, temperature=1.0, stream=True)))
  cases.append(("stream_drafts", dict(base, temperature=1.0, stream=True, drafts=True)))
  return cases


def run_library(sampler: Sampler, kwargs: dict) -> list:
  kwargs = dict(kwargs)
  constraint = kwargs.pop("constraint", None)
  if constraint == "regex":
    kwargs["constraint"] = sampler.constraint(regex=REGEX)
  elif constraint == "schema":
    kwargs["constraint"] = sampler.constraint(json_schema=SCHEMA)
  if kwargs.pop("stream", False):
    texts: dict[int, list] = {}
    for event in sampler.stream(**kwargs):
      texts.setdefault(event.index, []).append([event.text, event.draft, event.done, event.nfe])
    return [texts[i] for i in sorted(texts)]
  return [[s.tokens, s.nfe, s.steps, s.accepted, s.complete] for s in sampler.generate(**kwargs)]


def models(root: Path) -> dict[str, Path]:
  bundled = {name: default_checkpoint(name) for name in ("default", "default_ar", "default_bd")}
  tokenizer = bundled["default"] / "tokenizer.model"
  return {**bundled, **{f"random_{kind}": random_checkpoint(root, kind, tokenizer) for kind in RANDOM}}


def record_library(paths: dict[str, Path]) -> dict:
  out = {}
  for name, path in paths.items():
    sampler = Sampler.from_checkpoint(path)
    for label, kwargs in library_cases(name, sampler.cfg.objective):
      began = time.perf_counter()
      out[f"{name}/{label}"] = run_library(sampler, kwargs)
      print(f"{name}/{label}: {time.perf_counter() - began:.1f} s", flush=True)
  mesh = sh.make_mesh(MeshConfig(data=2, fsdp=2, tensor=2), jax.devices()[:8])
  for name in ("default", "default_bd"):
    sampler = Sampler.from_checkpoint(paths[name], mesh=mesh)
    out[f"{name}/mesh"] = run_library(sampler, dict(prompts=PROMPTS, length=24, seed=3, temperature=1.0))
  return out


SERVER_REQUESTS = [
  ("plain", "/v1/completions", dict(prompt="def fibonacci(n):", max_tokens=24, seed=5, temperature=1.0, n=2)),
  ("greedy", "/v1/completions", dict(prompt="import os\n", max_tokens=24, seed=5, temperature=0.0)),
  ("healing", "/v1/completions", dict(prompt="def fibon", max_tokens=16, seed=6, temperature=1.0)),
  ("fim", "/v1/completions", dict(prompt="def add(a, b):\n", suffix="\n\nprint(1)\n", max_tokens=16, seed=7)),
  ("schema", "/v1/completions", dict(prompt="{", max_tokens=40, seed=8, temperature=1.0,
                                     response_format={"type": "json_schema",
                                                      "json_schema": {"name": "x", "schema": SCHEMA}})),
  ("stream", "/v1/completions", dict(prompt="class A:", max_tokens=24, seed=9, temperature=1.0, stream=True,
                                     diffusing=True)),
]  # fmt: skip


def record_server(paths: dict[str, Path]) -> dict:
  import httpx

  out = {}
  for name in ("default", "default_ar", "default_bd", "random_whole_sequence", "random_continuous_block"):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the server on one device
    proc = subprocess.Popen(
      [sys.executable, "-m", "mercury_jax.serve", "--checkpoint", str(paths[name]), "--port", "0", "--slots", "4"],
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
      env=env,
    )
    url, seen = None, []
    for line in proc.stdout:
      seen.append(line)
      if line.startswith("serving") and "http://" in line:
        url = line.strip().split("http://")[1].split()[0]
        break
    assert url, f"{name}: the server did not start:\n{''.join(seen)}"
    try:
      with httpx.Client(base_url=f"http://{url}", timeout=300) as client:
        for label, path, body in SERVER_REQUESTS:
          if name == "random_continuous_block" and label in ("healing", "schema"):
            continue
          if body.get("stream"):
            events = []
            with client.stream("POST", path, json=body) as response:
              for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                  data = json.loads(line[6:])
                  events.append([[c.get("text"), c.get("diffusing"), c.get("finish_reason")] for c in data["choices"]])
            out[f"server/{name}/{label}"] = events
          else:
            response = client.post(path, json=body)
            data = response.json()
            out[f"server/{name}/{label}"] = [response.status_code] + [
              [c.get("text"), c.get("finish_reason")] for c in data.get("choices", [])
            ]
          print(f"server/{name}/{label}", flush=True)
    finally:
      proc.terminate()
      proc.wait(timeout=60)
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("mode", choices=("record", "check"))
  parser.add_argument("--out", type=Path, help="record: where to write the tokens")
  parser.add_argument("--golden", type=Path, help="check: the recorded tokens")
  parser.add_argument("--part", choices=("all", "library", "server"), default="all", help="which cases to run")
  args = parser.parse_args()
  tokens = {}

  def keep(new: dict) -> None:  # each part is written as soon as it is recorded
    tokens.update(json.loads(json.dumps(new)))  # tuples as lists, as read back
    if args.mode == "record":
      args.out.parent.mkdir(parents=True, exist_ok=True)
      before = json.loads(args.out.read_text()) if args.out.exists() else {}
      args.out.write_text(json.dumps(before | tokens, indent=0, sort_keys=True))
      print(f"{len(tokens)} cases written to {args.out}", flush=True)

  with tempfile.TemporaryDirectory() as tmp:
    paths = models(Path(tmp))
    if args.part in ("all", "library"):
      keep(record_library(paths))
    if args.part in ("all", "server"):
      keep(record_server(paths))
  if args.mode == "record":
    return
  golden = json.loads(args.golden.read_text())
  if args.part != "all":
    golden = {k: v for k, v in golden.items() if k.startswith("server/") == (args.part == "server")}
  differ = [k for k in golden if k in tokens and golden[k] != tokens[k]]
  missing = [k for k in golden if k not in tokens]
  for k in differ:
    print(f"DIFFERS: {k}")
  for k in missing:
    print(f"MISSING: {k}")
  print(f"{len(golden) - len(differ) - len(missing)} of {len(golden)} cases bitwise the same")
  sys.exit(1 if differ or missing else 0)


if __name__ == "__main__":
  main()
