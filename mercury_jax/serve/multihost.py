"""The serving engine on a multi-host mesh: every process runs process 0's commands, in the same order.

Process 0 serves HTTP and owns the queue; it broadcasts each :class:`~mercury_jax.serve.commands.Command` (a
fixed-shape tree of host arrays) and the specs of the constraints and healed characters it admits (a constraint's kind
and source, which compile to the same automaton on every process), and the other processes run the same programs
(:meth:`Processes.follow`). On one process every method is a pass-through.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mercury_jax.serve.commands import Admission, Command, spec_of


class Processes:
  """What one process does so that the others run the same programs (module docstring)."""

  def __init__(self, mesh: Mesh):
    self.mesh, self.many = mesh, jax.process_count() > 1
    self.leader = jax.process_index() == 0

  def place(self, array) -> jax.Array | np.ndarray:
    """A host array as a replicated global array on a multi-host mesh (every process passes the same values)."""
    if not self.many:
      return array
    array = np.asarray(array)
    sharding = NamedSharding(self.mesh, P())
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])

  def sync(self, out):
    """``out``, computed, on a multi-host mesh. XLA:CPU runs programs without a data dependency between them
    concurrently, so a prefill (or the next command's broadcast) could reach its collectives before the previous
    program's on one process and after them on another, which mismatches the collectives (gloo aborts)."""
    return jax.block_until_ready(out) if self.many else out

  def command(self, command: Command) -> Command:
    """Process 0's ``command``, on every process."""
    return multihost_utils.broadcast_one_to_all(command) if self.many else command

  def specs(self, command: Command, admission: Admission, compiler) -> None:
    """Every process's automata and healed characters of the command's admissions: process 0 broadcasts their specs
    (a constraint's kind and source; the healed text), the others compile them (cached)."""
    longest = int(max(command.constraint.max(initial=0), command.heal.max(initial=0)))
    if not self.many or not longest:
      return
    data = np.zeros((2, command.release.shape[0], longest), np.uint8)
    for slot, automaton in admission.automata.items():
      spec = spec_of(automaton)
      data[0, slot, : len(spec)] = np.frombuffer(spec, np.uint8)
    for slot, text in admission.heals.items():
      data[1, slot, : command.heal[slot]] = np.frombuffer(text.encode(), np.uint8)
    data = np.asarray(multihost_utils.broadcast_one_to_all(data))
    if self.leader:
      return
    for slot in np.flatnonzero(command.constraint):
      kind, _, source = bytes(data[0, slot, : command.constraint[slot]]).decode().partition("\n")
      compile_ = {"regex": compiler.regex, "json_schema": compiler.json_schema}.get(kind)
      admission.automata[int(slot)] = compile_(source) if compile_ else compiler.json_object()
    for slot in np.flatnonzero(command.heal):
      admission.heals[int(slot)] = bytes(data[1, slot, : command.heal[slot]]).decode()

  def follow(self, idle: Command, run: Callable[[Command], object]) -> None:
    """A process other than 0: runs process 0's commands (``run``) until it sends ``stop`` (``idle``: a command
    that does nothing, the broadcast's shape)."""
    while True:
      command = multihost_utils.broadcast_one_to_all(idle)
      if bool(command.stop):
        return
      run(command)

  def stop(self, idle: Command) -> None:
    """Process 0: tells the other processes to leave :meth:`follow`."""
    if self.many:
      multihost_utils.broadcast_one_to_all(idle._replace(stop=np.ones((), bool)))
