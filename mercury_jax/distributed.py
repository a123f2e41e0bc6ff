"""Joining JAX's multi-controller runtime: one process per host, every command the same code.

``jax.distributed.initialize`` is called when the command line names a coordinator, or when the environment is
one JAX detects by itself (Cloud TPU pod slices, SLURM jobs with more than one task, Kubernetes JobSets with the
coordinator variables set). A single process needs nothing.
"""

from __future__ import annotations

import argparse
import os

import jax

_AUTO_ENV = ("SLURM_NTASKS", "TPU_WORKER_HOSTNAMES", "JAX_COORDINATOR_ADDRESS", "MEGASCALE_COORDINATOR_ADDRESS")


def add_arguments(parser: argparse.ArgumentParser) -> None:
  group = parser.add_argument_group("multi-process (JAX distributed runtime)")
  group.add_argument("--coordinator", help="host:port of process 0; omit on Cloud TPU and under SLURM (auto)")
  group.add_argument("--num-processes", type=int, help="total number of processes (with --coordinator)")
  group.add_argument("--process-id", type=int, help="this process's index in [0, num-processes) (with --coordinator)")


def _auto_detectable() -> bool:
  if os.environ.get("SLURM_NTASKS", "1") not in ("", "1"):
    return True
  return any(os.environ.get(name) for name in _AUTO_ENV[1:])


def initialize(args: argparse.Namespace) -> None:
  """Initialises the distributed runtime from ``--coordinator ...`` flags or the environment; no-op otherwise."""
  explicit = [args.coordinator, args.num_processes, args.process_id]
  if any(v is not None for v in explicit):
    if any(v is None for v in explicit):
      raise SystemExit("--coordinator, --num-processes and --process-id must be given together")
    if not 0 <= args.process_id < args.num_processes:
      raise SystemExit(f"--process-id={args.process_id} must lie in [0, --num-processes={args.num_processes})")
    if args.num_processes > 1:
      jax.distributed.initialize(
        coordinator_address=args.coordinator, num_processes=args.num_processes, process_id=args.process_id
      )
    return
  if _auto_detectable():
    jax.distributed.initialize()


def is_primary() -> bool:
  """True on the process that writes logs, metrics and other single-writer files."""
  return jax.process_index() == 0
