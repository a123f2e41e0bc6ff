"""``python -m mercury_jax.aot --config NAME``: lower and compile a preset's train step ahead of time.

With no accelerator at hand, the preset's mesh is simulated with that many CPU devices (the module sets
``--xla_force_host_platform_device_count`` itself when run as a command), so a mesh or sharding mistake in an
accelerator-scale preset shows up on a laptop. Prints the parameter count, per-device memory and FLOPs.
"""

from __future__ import annotations

import argparse
import math
import os
import sys


def _mesh_devices(argv: list[str] | None) -> int | None:
  """Reads the preset's mesh size before jax is imported (the simulated device count must be set first)."""
  from mercury_jax.config import ConfigError, load_config, parse_set_args

  args, _ = _parser().parse_known_args(argv)
  try:
    cfg = load_config(args.config, parse_set_args(args.set))
  except ConfigError:
    return None
  sizes = (cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)
  return None if -1 in sizes else math.prod(sizes)


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="python -m mercury_jax.aot", description=__doc__.split("\n")[0])
  parser.add_argument("--config", required=True, help="a preset name from configs/ or a TOML file")
  parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
  return parser


def compile_report(cfg) -> dict[str, float]:
  """Lowers and compiles the train step of ``cfg`` on the available devices; returns size and cost figures."""
  import jax

  from mercury_jax import sharding as sh
  from mercury_jax.model import Transformer
  from mercury_jax.trainer import Trainer, abstract_params

  mesh = sh.make_mesh(cfg.mesh)
  trainer = Trainer(cfg, mesh)
  params = abstract_params(Transformer(cfg.model), mesh, trainer.rules)
  num_params = sum(math.prod(p.shape) for p in jax.tree.leaves(params))
  compiled = trainer.lower_train_step().compile()
  report = {"params": num_params, "devices": mesh.size}
  memory = compiled.memory_analysis()
  if memory is not None:
    report["argument_bytes_per_device"] = memory.argument_size_in_bytes
    report["temp_bytes_per_device"] = memory.temp_size_in_bytes
  costs = compiled.cost_analysis()
  if isinstance(costs, list):
    costs = costs[0] if costs else {}
  if costs and "flops" in costs:
    report["flops_per_device"] = costs["flops"]
  return report


def main(argv: list[str] | None = None) -> None:
  devices = _mesh_devices(argv)
  if devices and "jax" not in sys.modules:
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
  from mercury_jax.config import ConfigError, load_config, parse_set_args

  args = _parser().parse_args(argv)
  try:
    cfg = load_config(args.config, parse_set_args(args.set))
    report = compile_report(cfg)
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    raise SystemExit(2) from None
  print(
    f"{cfg.name}: compiled the train step on {report['devices']} devices; {report['params'] / 1e6:.1f} M parameters"
  )
  for key, value in report.items():
    if key not in ("params", "devices"):
      print(f"  {key}: {value / 2**30:.3f} GiB" if key.endswith("bytes_per_device") else f"  {key}: {value:.3e}")


if __name__ == "__main__":
  main()
