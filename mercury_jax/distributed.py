"""Joining JAX's multi-controller runtime: one process per host (or per GPU), every command the same code.

Every command calls :func:`initialize` before it touches a device. It calls ``jax.distributed.initialize``

- with ``--coordinator HOST:PORT --num-processes N --process-id I`` when they are given (anywhere: one machine,
  Kubernetes, bare hosts);
- with nothing when the launcher is one JAX reads by itself (``launcher()``): an ``srun`` step of more than one
  SLURM task, an ``mpirun`` of more than one Open MPI rank, or a Cloud TPU VM (a pod slice's hosts find each
  other through the GCE metadata server, or ``TPU_WORKER_HOSTNAMES`` on GKE);
- not at all otherwise: a single process needs nothing.

These are the launchers ``jax.distributed.initialize()`` detects in JAX 0.10 (``jax/_src/clusters``). We check
their variables ourselves so that a single process never starts a coordinator: JAX would also bootstrap a
one-task SLURM step or a Kubernetes pod (the latter needs the ``kubernetes`` package and pod-reading RBAC, so the
Kubernetes recipe passes the flags instead). JAX also reads ``JAX_COORDINATOR_PORT`` (another port for the
detected coordinator) and ``JAX_LOCAL_DEVICE_IDS`` (the GPUs this process drives).

Preemption: after ``jax.distributed.initialize`` JAX's preemption sync manager handles SIGTERM; see
:class:`Preemption`.
"""

from __future__ import annotations

import argparse
import glob
import os
import secrets
import signal
from pathlib import Path
from types import FrameType

import jax
import numpy as np
from jax.experimental import multihost_utils

_OPEN_MPI_URI = "OMPI_MCA_orte_hnp_uri"  # Set by mpirun (Open MPI 4); the exact name JAX's detector reads.
_SLURM_STEP = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")


def add_arguments(parser: argparse.ArgumentParser) -> None:
  """Adds ``--coordinator``, ``--num-processes`` and ``--process-id`` (every command takes them)."""
  group = parser.add_argument_group("multi-process (JAX distributed runtime; automatic on Cloud TPU, SLURM, mpirun)")
  group.add_argument("--coordinator", help="HOST:PORT where process 0 serves the coordinator (a free port)")
  group.add_argument("--num-processes", type=int, help="total number of processes (with --coordinator)")
  group.add_argument("--process-id", type=int, help="this process's index in [0, num-processes) (with --coordinator)")


def _int_env(name: str) -> int:
  try:
    return int(os.environ.get(name, ""))
  except ValueError:
    return 0


def _on_cloud_tpu_vm() -> bool:
  platforms = os.environ.get("JAX_PLATFORMS", "")
  if platforms and "tpu" not in platforms.split(","):
    return False  # A CPU-only run on a TPU VM (tests, tools) is one process.
  # Set by ``import jax`` when libtpu and TPU chips are present; JAX's TPU cluster detectors test the same flag.
  from jax._src import cloud_tpu_init

  if not getattr(cloud_tpu_init, "running_in_cloud_tpu_vm", False):
    return False
  gke = os.environ.get("TPU_WORKER_HOSTNAMES") or os.environ.get("TPU_PROCESS_ADDRESSES")
  return bool(gke) or os.environ.get("TPU_SKIP_MDS_QUERY") is None  # GKE, or GCE with its metadata server.


def launcher() -> str | None:
  """The multi-process launcher JAX reads this process's place from: ``"slurm"``, ``"mpirun"``, ``"tpu"`` or None."""
  if os.environ.get(_OPEN_MPI_URI) and _int_env("OMPI_COMM_WORLD_SIZE") > 1:
    return "mpirun"  # JAX checks Open MPI before SLURM (mpirun inside an allocation).
  if all(name in os.environ for name in _SLURM_STEP) and _int_env("SLURM_NTASKS") > 1:
    return "slurm"
  if _on_cloud_tpu_vm():
    return "tpu"
  return None


def _visible_gpus() -> int:
  visible = os.environ.get("CUDA_VISIBLE_DEVICES")
  if visible is not None:
    return len([d for d in visible.split(",") if d.strip()])
  return len([d for d in glob.glob("/dev/nvidia*") if d.removeprefix("/dev/nvidia").isdigit()])


def local_device_ids(name: str | None) -> list[int] | None:
  """GPUs this process drives under ``launcher() == name``; None keeps JAX's choice.

  Under SLURM and mpirun JAX gives each process the one GPU numbered by its local rank (one process per GPU).
  With one task per node that would leave all but GPU 0 idle, so then every visible GPU is this process's.
  ``JAX_LOCAL_DEVICE_IDS`` overrides both.
  """
  if name not in ("slurm", "mpirun") or "JAX_LOCAL_DEVICE_IDS" in os.environ:
    return None
  if name == "slurm":
    one_per_node = _int_env("SLURM_NTASKS") == _int_env("SLURM_STEP_NUM_NODES")
  else:
    one_per_node = _int_env("OMPI_COMM_WORLD_LOCAL_SIZE") == 1
  gpus = _visible_gpus()
  return list(range(gpus)) if one_per_node and gpus > 1 else None


def initialize(args: argparse.Namespace) -> None:
  """Joins the distributed runtime from ``--coordinator ...`` flags or the launcher; no-op for one process."""
  explicit = [args.coordinator, args.num_processes, args.process_id]
  if any(v is not None for v in explicit):
    if any(v is None for v in explicit):
      raise SystemExit("--coordinator, --num-processes and --process-id must be given together")
    if args.num_processes < 1 or not 0 <= args.process_id < args.num_processes:
      raise SystemExit(f"--process-id={args.process_id} must lie in [0, --num-processes={args.num_processes})")
    host, sep, port = args.coordinator.rpartition(":")
    if not sep or not host or not port.isdigit():
      raise SystemExit(f"--coordinator={args.coordinator!r} must be HOST:PORT, e.g. localhost:12345 or node0:1234")
    if args.num_processes > 1:
      jax.distributed.initialize(
        coordinator_address=args.coordinator, num_processes=args.num_processes, process_id=args.process_id
      )
    return
  name = launcher()
  if name is not None:
    jax.distributed.initialize(local_device_ids=local_device_ids(name))


def is_primary() -> bool:
  """True on the process that writes logs, metrics and other single-writer files."""
  return jax.process_index() == 0


def check_shared_directory(path: str | Path, flag: str) -> None:
  """Exits with one line unless every process sees ``path`` as the same directory (a no-op for one process).

  Orbax writes each host's shards of a checkpoint into one folder and process 0 finalises it, so the workdir of a
  multi-host run must be on a filesystem all hosts share; on host-local disks every checkpoint would be incomplete.
  """
  if jax.process_count() == 1:
    return
  marker = Path(path) / ".mercury_jax_shared_check"
  token = str(int(multihost_utils.broadcast_one_to_all(np.int32(secrets.randbits(31)))))
  if is_primary():
    marker.write_text(token)
  multihost_utils.sync_global_devices("mercury_jax: shared directory written")
  try:
    sees = marker.read_text() == token
  except OSError:
    sees = False
  seen = np.asarray(multihost_utils.process_allgather(np.asarray(sees)))
  multihost_utils.sync_global_devices("mercury_jax: shared directory read")
  if is_primary():
    marker.unlink(missing_ok=True)
  if not seen.all():
    blind = [int(i) for i in np.flatnonzero(~seen)]
    raise SystemExit(
      f"{flag} {str(path)!r} is not one directory shared by all hosts (process(es) {blind} do not see what "
      "process 0 writes there); put it on a filesystem every host mounts at the same path (NFS, Filestore, Lustre)"
    )


class Preemption:
  """SIGTERM on any one process makes every process stop after the same step.

  One process: a Python SIGTERM handler records the signal and :meth:`reached` is True from then on. Several
  processes (after ``jax.distributed.initialize``): JAX's preemption sync manager has already installed a SIGTERM
  handler (a Python one would replace it, so none is installed); the process that gets the signal tells the
  coordinator, which picks the step after the largest one any process has reported, and :meth:`reached` is True at
  exactly that step on every process. A call costs under a microsecond (it reads a step the manager sets in the
  background; a per-step all-gather of a stop flag would cost milliseconds), so call it once per step with
  increasing steps, starting from the same step on every process.

  Use as a context manager around the training loop.
  """

  def __init__(self):
    self.signum: int | None = None
    self.coordinated = False
    self._previous = None

  def __enter__(self) -> Preemption:
    self.coordinated = jax.distributed.is_initialized()
    if self.coordinated and not jax.config.jax_enable_preemption_service:
      raise SystemExit(
        "jax_enable_preemption_service is off, so processes cannot agree on a step to stop at after SIGTERM; "
        "turn it back on (it is JAX's default)"
      )
    if not self.coordinated:
      self._previous = signal.signal(signal.SIGTERM, self._record)
    return self

  def __exit__(self, *exc) -> None:
    if not self.coordinated:
      signal.signal(signal.SIGTERM, self._previous)

  def _record(self, signum: int, _: FrameType | None) -> None:
    self.signum = signum

  def reached(self, step: int) -> bool:
    """True when this process should save ``step`` and stop (the same step on every process)."""
    if self.coordinated:
      return multihost_utils.reached_preemption_sync_point(step)
    return self.signum is not None

  def describe(self) -> str:
    """What stopped the run, for the log line."""
    if self.coordinated:
      return f"received SIGTERM on one of the {jax.process_count()} processes; all stopped at the same step"
    return f"received signal {self.signum}"
