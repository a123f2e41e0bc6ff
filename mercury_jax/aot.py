"""``python -m mercury_jax.aot``: compile a train step or a sampling program ahead of time, without weights.

With no accelerator at hand, the mesh is simulated with that many CPU devices (the module sets
``--xla_force_host_platform_device_count`` itself when run as a command), so a mesh or sharding mistake in an
accelerator-scale model shows up on a laptop. Two modes:

* ``--config NAME``: lowers and compiles a preset's train step on the preset's mesh; prints the parameter count,
  per-device memory and FLOPs.
* ``--sample`` with ``--checkpoint DIR`` (a converted or trained checkpoint: only its stored config is read),
  ``--hf-config PATH`` (a Hugging Face ``config.json``, mapped by :func:`mercury_jax.convert.config_from_hf`),
  ``--family F [--size S]`` (a public model's ``config.json`` shipped in ``configs/public/``) or ``--config NAME`` (a
  preset, on its own mesh unless ``--mesh`` says otherwise): lowers and compiles
  the very programs ``Sampler`` runs (:class:`~mercury_jax.sampling.programs.Programs`: the prefill, then the loop
  over every block) for the decoder the checkpoint runs (:func:`~mercury_jax.sampling.plan.plan_for` with its
  ``[sampling]`` defaults: whole canvas, semi-autoregressive blocks or the exact cache), with abstract parameters in
  the checkpoint's dtype split over ``fsdp`` x ``tensor`` by the model's logical axis rules, at each ``--batch``
  size, on a canvas of ``--length`` positions (prompt and generation: the split is traced data and does not change
  the program). A batch is padded to the data-parallel size as the sampler pads it (``rows``). Prints per-device
  argument, temporary and output bytes from XLA's memory analysis of the larger of the two (they run one after the
  other); the step count is traced, so it changes nothing.
  With ``--prefill`` it compiles only the engine's start (:meth:`~mercury_jax.sampling.engine.BlockEngine.init`): the
  prefill of a prompt that fills all of the canvas but its last block, and the first block's state; its output is
  the state, the key-value cache included. On a mesh with a ``sequence`` axis the prefill runs context-parallel.

Examples::

  python -m mercury_jax.aot --sample --family llada --batch 1,16 --length 1024 --mesh data=1,fsdp=4,tensor=2
  python -m mercury_jax.aot --sample --prefill --config pod64_1b_128k --set objective.block_size=8 --batch 1 \
    --length 131072
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from importlib import resources
from pathlib import Path

from mercury_jax.config import Config, ConfigError, MeshConfig
from mercury_jax.files import CHECKPOINTS

# Public models' config.json files shipped in configs/public/ (provenance in its README.md): family -> size -> file.
# A family's first size is its default.
PUBLIC_CONFIGS = {
  "llada": {"8b": "llada-8b-instruct.json"},
  "dream": {"7b": "dream-v0-instruct-7b.json"},
  "sdar": {"8b": "sdar-8b-chat.json", "4b": "sdar-4b-chat.json"},
  "fast_dllm_v2": {"7b": "fast-dllm-v2-7b.json"},
}
DEFAULT_MESH = "data=1,fsdp=4,tensor=2"
MESH_AXES = ("data", "fsdp", "sequence", "tensor")  # sharding.MESH_AXES; jax loads only after the device count
GIB = 2**30


class AotError(ValueError):
  """Bad input to the command (one line: the value and what would be right); the command exits with status 2."""


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="python -m mercury_jax.aot", description=__doc__.split("\n")[0])
  parser.add_argument("--config", help="train-step mode: a preset name from configs/ or a TOML file")
  parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
  parser.add_argument("--sample", action="store_true", help="sampling mode: compile the decoding engine")
  source = parser.add_mutually_exclusive_group()
  source.add_argument("--checkpoint", help="a mercury_jax checkpoint folder (its stored config only)")
  source.add_argument("--hf-config", help="a Hugging Face config.json")
  source.add_argument("--family", help=f"a public model shipped in configs/public: {', '.join(PUBLIC_CONFIGS)}")
  parser.add_argument("--size", help="the public model's size (with --family), e.g. 8b; default: the family's first")
  parser.add_argument("--batch", default="1,16", help="comma-separated batch sizes (default 1,16)")
  parser.add_argument("--length", type=int, default=1024, help="canvas positions: prompt + generation (default 1024)")
  parser.add_argument(
    "--mesh", help=f"sampling: axis=size pairs (default: a --config preset's mesh, else {DEFAULT_MESH})"
  )
  parser.add_argument("--cache", default="auto", help="the decoder's cache: auto (the checkpoint's), exact, none, ...")
  parser.add_argument("--prefill", action="store_true", help="sampling: compile the prefill and start only")
  return parser


def parse_mesh(spec: str) -> MeshConfig:
  """``"data=1,fsdp=4,tensor=2"`` as a :class:`MeshConfig` (axes left out have size 1).

  Raises:
    AotError: an unknown axis or a size that is not a positive integer.
  """
  sizes = dict.fromkeys(MESH_AXES, 1)
  for item in spec.split(","):
    axis, sep, value = item.partition("=")
    if not sep or axis.strip() not in sizes or not value.strip().isdigit() or int(value) < 1:
      raise AotError(f"--mesh {spec!r} must be axis=size pairs over {', '.join(MESH_AXES)}, e.g. {DEFAULT_MESH}")
    sizes[axis.strip()] = int(value)
  return MeshConfig(**sizes)


def _batches(spec: str) -> list[int]:
  try:
    batches = [int(b) for b in spec.split(",")]
  except ValueError:
    batches = []
  if not batches or min(batches) < 1:
    raise AotError(f"--batch {spec!r} must be comma-separated positive integers, e.g. 1,16")
  return batches


def _mesh_devices(argv: list[str] | None) -> int | None:
  """Reads the mesh size before jax is imported (the simulated device count must be set first)."""
  from mercury_jax.config import load_config, parse_set_args

  args, _ = _parser().parse_known_args(argv)
  if args.sample and (args.mesh or not args.config):
    try:
      mesh = parse_mesh(args.mesh or DEFAULT_MESH)
      return mesh.data * mesh.fsdp * mesh.sequence * mesh.tensor
    except AotError:
      return None
  if args.config is None:
    return None
  try:
    cfg = load_config(args.config, parse_set_args(args.set))
  except ConfigError:
    return None
  sizes = (cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.sequence, cfg.mesh.tensor)
  return None if -1 in sizes else math.prod(sizes)


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


# ------------------------------------------------------------------------------------------------ sampling


def public_config_file(family: str, size: str | None = None):
  """The shipped ``config.json`` of a public model (``configs/public/``; ``mercury_jax.configs`` in a wheel).

  Raises:
    AotError: an unknown family or size.
  """
  if family not in PUBLIC_CONFIGS:
    raise AotError(f"--family {family!r} is unknown; shipped families: {', '.join(PUBLIC_CONFIGS)}")
  sizes = PUBLIC_CONFIGS[family]
  size = next(iter(sizes)) if size is None else size.lower()
  if size not in sizes:
    raise AotError(f"--size {size!r} is not shipped for family {family}; sizes: {', '.join(sizes)}")
  try:
    folder = resources.files("mercury_jax.configs") / "public"
  except ModuleNotFoundError:
    folder = Path(__file__).resolve().parent.parent / "configs" / "public"
  return folder / sizes[size]


def _hf_config(path, family: str = "auto") -> Config:
  from mercury_jax.convert import ConvertError, config_from_hf

  if not path.is_file():
    raise AotError(f"--hf-config {str(path)!r}: no such file (expected a Hugging Face config.json)")
  try:
    hf = json.loads(path.read_text())
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise AotError(f"--hf-config {str(path)!r} is not JSON: {e}") from None
  if not isinstance(hf, dict):
    raise AotError(f"--hf-config {str(path)!r} holds a {type(hf).__name__}, not a config.json object")
  try:
    return config_from_hf(hf, family)
  except ConvertError as e:
    raise AotError(f"{path.name}: {e}") from None


def checkpoint_config(path: str | Path) -> Config:
  """The stored config of a checkpoint (a converted model's folder, a train workdir, its ``checkpoints`` folder or
  a step folder), read without its parameters.

  Raises:
    AotError: no such folder, or no readable config in it.
  """
  import orbax.checkpoint as ocp

  from mercury_jax.config import config_from_dict

  root, step = Path(path).absolute(), None
  if not root.is_dir():
    raise AotError(f"--checkpoint {str(path)!r}: no such folder")
  if (root / CHECKPOINTS).is_dir():
    root = root / CHECKPOINTS
  elif root.name.isdigit() and (root / "config").is_dir():
    root, step = root.parent, int(root.name)
  with ocp.CheckpointManager(root, item_names=("config",)) as manager:
    step = manager.latest_step() if step is None else step
    if step is None:
      raise AotError(f"--checkpoint {str(path)!r} has no step folders (expected a converted or trained checkpoint)")
    try:
      tree = manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore())).config
    except Exception as e:  # Orbax raises several types for a missing or foreign item.
      raise AotError(f"--checkpoint {str(path)!r} step {step} has no readable mercury_jax config: {e}") from None
  return config_from_dict(tree)


def sample_config(args: argparse.Namespace) -> Config:
  """The config that ``--checkpoint``, ``--hf-config`` or ``--family``/``--size`` name, with ``--set`` applied.

  Raises:
    AotError: no source or a bad one.
  """
  from mercury_jax.config import apply_overrides, parse_set_args

  if args.size and not args.family:
    raise AotError(f"--size {args.size!r} needs --family")
  from mercury_jax.config import load_config

  sources = [name for name in ("checkpoint", "hf_config", "family", "config") if getattr(args, name)]
  if len(sources) != 1:
    raise AotError("--sample needs exactly one of --checkpoint DIR, --hf-config PATH, --family NAME, --config NAME")
  if args.config:
    return load_config(args.config, parse_set_args(args.set))
  if args.checkpoint:
    cfg = checkpoint_config(args.checkpoint)
  elif args.hf_config:
    cfg = _hf_config(Path(args.hf_config))
  else:
    cfg = _hf_config(public_config_file(args.family, args.size), args.family)
  return apply_overrides(cfg, parse_set_args(args.set)).validate()


@dataclasses.dataclass(frozen=True)
class _TokenIds:
  """The special ids the engine's settings need, where no tokenizer is read (they are compile-time constants that
  change no shape): mercury_jax's own layout."""

  vocab_size: int
  pad_id: int = 0
  unk_id: int = 1
  bos_id: int = 2
  eos_id: int = 3
  stop_ids: tuple[int, ...] = (3,)


def check_divides(params, mesh) -> None:
  """Every parameter dimension split over mesh axes is a multiple of their size.

  Raises:
    AotError: naming the parameter, its dimension and the axes.
  """
  import jax

  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    for dim, (size, axes) in enumerate(zip(leaf.shape, leaf.sharding.spec, strict=False)):
      axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
      ways = math.prod(mesh.shape[a] for a in axes)
      if size % ways:
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        split = "x".join(f"{a}={mesh.shape[a]}" for a in axes)
        raise AotError(
          f"parameter {name} has {size} along dimension {dim}, which {split} does not divide; resize --mesh"
        )


def sample_report(
  cfg: Config, mesh_cfg: MeshConfig, batch: int, length: int, cache: str = "auto", prefill: bool = False
) -> dict:
  """Lowers and compiles the engine's whole generation (or, with ``prefill``, its start: the prefill of a prompt
  covering all but the canvas's last block) for ``cfg`` at ``batch`` x ``length`` on a mesh of the first devices,
  with abstract parameters (no weights); returns sizes and per-device memory.

  Returns:
    A dict: ``params`` (count), ``param_bytes`` (all of them), ``param_bytes_per_device`` (the largest device's share
    by the shardings), ``rows`` (the batch padded to the data-parallel size), ``length`` (the planned canvas),
    ``decoder`` (cache and block), ``state_bytes`` and ``state_bytes_per_device`` (the loop state the prefill hands
    the loop; 0 with ``prefill``), and ``argument``, ``temp``, ``output``, ``alias`` and ``total`` bytes per device
    (of the larger program).

  Raises:
    AotError: a mesh that does not fit the devices or the parameters, a length the model cannot take, or a cache
      the model does not have.
  """
  import jax
  import jax.numpy as jnp
  import numpy as np

  from mercury_jax import kinds as K, sharding as sh
  from mercury_jax.model import Transformer, abstract_params
  from mercury_jax.sampling import canvas as cv
  from mercury_jax.sampling.engine import Start, prefill_slots
  from mercury_jax.sampling.jobs import Jobs
  from mercury_jax.sampling.network import Network
  from mercury_jax.sampling.plan import Decoding
  from mercury_jax.sampling.programs import Programs
  from mercury_jax.sampling.proposal import Knobs
  from mercury_jax.sampling.settings import SettingError

  devices = math.prod((mesh_cfg.data, mesh_cfg.fsdp, mesh_cfg.sequence, mesh_cfg.tensor))
  if devices > len(jax.devices()):
    raise AotError(f"--mesh needs {devices} devices but {len(jax.devices())} are available")
  if not 1 <= length <= cfg.model.max_length:
    raise AotError(f"--length {length} must lie in [1, {cfg.model.max_length}] (the model's max_length)")
  # The sampler runs the layer stack as a loop (Sampler.__init__), whatever the training chose.
  cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, unroll_layers=False))
  mesh = sh.make_mesh(mesh_cfg, jax.devices()[:devices])
  rules = sh.axis_rules(cfg.mesh)
  params = abstract_params(Transformer(cfg.model), mesh, rules)
  check_divides(params, mesh)

  jobs = Jobs(cfg, _TokenIds(cfg.model.vocab_size), None)  # no placement: nothing is put on devices
  try:
    settings = jobs.settings()
    decoding = Decoding.of(settings, cache)
    plan = jobs.plan(decoding, length)
  except SettingError as e:
    raise AotError(e.named(f"--{e.field.replace('_', '-')}")) from None
  prompt = length // 2 if length > 1 else 0
  if prefill:
    prompt = max(length - max(plan.block, 1), 0)
  kinds = np.full((batch, length), K.TARGET, np.int32)
  kinds[:, :prompt] = K.FIXED
  canvas = cv.pad_length(cv.Canvas(np.zeros_like(kinds), kinds, np.arange(batch, dtype=np.int32)), plan.length)
  canvas = cv.pad_batch(canvas, sh.data_parallel_size(mesh, rules))
  programs = Programs(Network(cfg.model), mesh, rules, jax.tree.map(lambda p: p.sharding, params))
  engine = programs.engine(settings, plan)
  init = programs.prefill(engine, prefill_slots(canvas.kinds, plan))  # as the Sampler runs it
  replicated = jax.sharding.NamedSharding(mesh, jax.P())
  rows = lambda a, dtype: jax.ShapeDtypeStruct(np.shape(a), dtype, sharding=sh.batch_sharding(mesh, rules, np.ndim(a)))  # noqa: E731
  scalar = lambda dtype: jax.ShapeDtypeStruct((), dtype, sharding=replicated)  # noqa: E731
  per_row = rows(canvas.streams, jnp.int32)  # steps per block and extra steps, per row
  start = Start(
    cv.Canvas(*(rows(a, jnp.int32) for a in canvas)),
    jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=replicated),  # the key's data, as Placement.key places it
    per_row,
    Knobs(scalar(jnp.float32), scalar(jnp.int32), scalar(jnp.float32), scalar(jnp.float32)),
    extra_steps=per_row,
  )
  compiled = [init.lower(params, start).compile()]
  if not prefill:  # and the loop, over the state the prefill leaves
    state = jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
      compiled[0].out_info,
      compiled[0].output_shardings,
    )
    compiled.append(programs.advance(engine).lower(params, state, scalar(jnp.int32), scalar(jnp.int32)).compile())
  leaves = jax.tree.leaves(params)
  states = jax.tree.leaves(state) if not prefill else []
  report = {
    "params": sum(math.prod(p.shape) for p in leaves),
    "param_bytes": sum(math.prod(p.shape) * p.dtype.itemsize for p in leaves),
    "param_bytes_per_device": sum(math.prod(p.sharding.shard_shape(p.shape)) * p.dtype.itemsize for p in leaves),
    "rows": int(np.shape(canvas.tokens)[0]),
    "length": int(np.shape(canvas.tokens)[1]),
    "decoder": f"cache={plan.cache} block={plan.block}" + (" (prefill)" if prefill else ""),
    "devices": mesh.size,
    "state_bytes": sum(math.prod(a.shape) * a.dtype.itemsize for a in states),
    "state_bytes_per_device": sum(math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize for a in states),
  }
  return report | _memory(compiled)


def _memory(compiled: list) -> dict:
  """Per-device bytes of the largest of the programs (they run one after the other): ``argument``, ``temp``,
  ``output``, ``alias`` and their ``total``; nothing when XLA has no memory analysis."""
  reports = []
  for program in compiled:
    memory = program.memory_analysis()
    if memory is None:
      return {}
    r = {
      "argument": memory.argument_size_in_bytes,
      "temp": memory.temp_size_in_bytes,
      "output": memory.output_size_in_bytes,
      "alias": memory.alias_size_in_bytes,
    }
    reports.append(r | {"total": r["argument"] + r["temp"] + r["output"] - r["alias"]})
  return max(reports, key=lambda r: r["total"])


def _sample_main(args: argparse.Namespace) -> None:
  batches = _batches(args.batch)
  cfg = sample_config(args)
  mesh_cfg = cfg.mesh if args.config and not args.mesh else parse_mesh(args.mesh or DEFAULT_MESH)
  mesh_name = ",".join(f"{a}={getattr(mesh_cfg, a)}" for a in MESH_AXES if getattr(mesh_cfg, a) != 1) or "data=1"
  name = cfg.name
  if args.family:
    name = f"{args.family}-{(args.size or next(iter(PUBLIC_CONFIGS[args.family]))).lower()}"
  reports = []
  for batch in batches:
    reports.append(sample_report(cfg, mesh_cfg, batch, args.length, args.cache, args.prefill))
    if len(reports) == 1:
      first = reports[0]
      print(
        f"{name}: {cfg.model.param_dtype} parameters, {cfg.model.dtype} activations, {first['decoder']}, mesh "
        f"{mesh_name} ({first['devices']} devices); parameters {first['param_bytes'] / GIB:.2f} GiB in all, "
        f"{first['param_bytes_per_device'] / GIB:.3f} GiB per device by their shardings"
      )
      print(
        f"{'model':<16} {'params (B)':>10} {'batch':>5} {'rows':>4} {'length':>6} {'args GiB':>9} {'temp GiB':>9} "
        f"{'out GiB':>8} {'total GiB':>9}"
      )
    r = reports[-1]
    if "total" not in r:
      print(f"{name:<16} {r['params'] / 1e9:>10.2f} {batch:>5} {r['rows']:>4} {r['length']:>6}  (no memory analysis)")
      continue
    print(
      f"{name:<16} {r['params'] / 1e9:>10.2f} {batch:>5} {r['rows']:>4} {r['length']:>6} {r['argument'] / GIB:>9.3f} "
      f"{r['temp'] / GIB:>9.3f} {r['output'] / GIB:>8.4f} {r['total'] / GIB:>9.3f}",
      flush=True,
    )
  import jax

  if jax.default_backend() == "cpu" and "bfloat16" in (cfg.model.param_dtype, cfg.model.dtype):
    print(
      "note: XLA:CPU widens bfloat16 matmuls to float32 and hoists the widened weights out of the decoding loop: "
      "temp includes float32 copies of the weights that a GPU or TPU compilation does not hold"
    )


def main(argv: list[str] | None = None) -> None:
  devices = _mesh_devices(argv)
  if devices and "jax" not in sys.modules:
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
  from mercury_jax.config import load_config, parse_set_args

  args = _parser().parse_args(argv)
  if not args.sample and not args.config:
    print("error: give --config NAME (train step) or --sample (sampling)", file=sys.stderr)
    raise SystemExit(2)
  if args.prefill and not args.sample:
    print("error: --prefill compiles a sampling program's start; add --sample", file=sys.stderr)
    raise SystemExit(2)
  try:
    if args.sample:
      _sample_main(args)
      return
    cfg = load_config(args.config, parse_set_args(args.set))
    report = compile_report(cfg)
  except (ConfigError, AotError) as e:
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
