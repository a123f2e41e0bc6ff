"""One trainer for every mesh: a sharded step equals the single-device step, and parameters really are sharded."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mercury_jax import sharding as sh
from mercury_jax.config import MeshConfig, load_config
from mercury_jax.trainer import Trainer

CFG = load_config(
  "tiny",
  {
    "model.vocab_size": "256",
    "model.max_length": "32",
    "model.num_kv_heads": "2",
    "model.time_conditioning": "true",
    "optim.warmup_steps": "0",
  },
)


def _batch(seed: int) -> dict[str, jax.Array]:
  rng = np.random.default_rng(seed)
  kinds = np.full((8, 32), 2, np.int32)
  kinds[:2, :6] = 1  # Two conditional examples with prompts...
  kinds[:2, -5:] = 0  # ...and padding.
  return {"tokens": jnp.asarray(rng.integers(5, 256, (8, 32)), jnp.int32), "kinds": jnp.asarray(kinds)}


def _run(cfg, devices, steps=2):
  trainer = Trainer(cfg, sh.make_mesh(cfg.mesh, devices))
  state = trainer.init_state(seed=0)
  losses = []
  for i in range(steps):
    batch = jax.device_put(_batch(i), trainer.batch_sharding)
    state, metrics = trainer.train_step(state, batch)
    losses.append(float(metrics["loss"]))
  return trainer, state, losses


@pytest.mark.parametrize("objective", ["masked_diffusion", "autoregressive"])
def test_sharded_train_steps_equal_single_device(objective):
  cfg = CFG
  if objective == "autoregressive":
    cfg = dataclasses.replace(
      cfg,
      model=dataclasses.replace(cfg.model, causal=True, time_conditioning=False),
      objective=dataclasses.replace(cfg.objective, name="autoregressive"),
    )
  single_cfg = dataclasses.replace(cfg, mesh=MeshConfig(data=1))
  _, single, single_losses = _run(single_cfg, jax.devices()[:1])
  mesh_cfg = dataclasses.replace(cfg, mesh=MeshConfig(data=2, fsdp=2, tensor=2))
  _, sharded, sharded_losses = _run(mesh_cfg, jax.devices())
  np.testing.assert_allclose(sharded_losses, single_losses, rtol=1e-5)
  # Adam's first updates are g / sqrt(g^2): reduction-order rounding in tiny gradients moves a parameter by a
  # small fraction of one update (lr = 1e-3), so compare to 1% of the learning rate.
  atol = 1e-2 * cfg.optim.learning_rate
  for a, b in zip(jax.tree.leaves(single["params"]), jax.tree.leaves(sharded["params"]), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=atol, rtol=1e-5)
  assert int(sharded["step"]) == 2


def test_parameters_are_sharded_per_the_rules():
  cfg = dataclasses.replace(CFG, mesh=MeshConfig(data=2, fsdp=2, tensor=2))
  trainer = Trainer(cfg, sh.make_mesh(cfg.mesh))
  state = trainer.init_state(seed=0)
  params = state["params"]
  assert params["blocks"]["attention"]["query"].sharding.spec == jax.P(None, "fsdp", "tensor", None)
  assert params["blocks"]["mlp"]["down"].sharding.spec == jax.P(None, "tensor", "fsdp")
  assert params["embedding"].sharding.spec == jax.P("tensor", "fsdp")
  # Every large parameter holds at most a quarter of its elements on each device (MaxText-style check).
  total = sum(p.size for p in jax.tree.leaves(params))
  per_device = sum(math.prod(p.sharding.shard_shape(p.shape)) for p in jax.tree.leaves(params))
  assert per_device / total < 0.3, per_device / total
  # Optimiser moments follow their parameters.
  mu = state["opt_state"][1][0].mu
  assert mu["blocks"]["attention"]["query"].sharding.spec == params["blocks"]["attention"]["query"].sharding.spec


def test_nonfinite_loss_keeps_the_previous_state():
  cfg = dataclasses.replace(CFG, mesh=MeshConfig(data=1))
  trainer = Trainer(cfg, sh.make_mesh(cfg.mesh, jax.devices()[:1]))
  state = trainer.init_state(seed=0)
  before = jax.tree.map(np.asarray, state["params"])
  poisoned = dict(state, params=jax.tree.map(lambda p: p, state["params"]))
  poisoned["params"]["final_norm"]["scale"] = state["params"]["final_norm"]["scale"] * jnp.nan
  new, metrics = trainer.train_step(poisoned, jax.device_put(_batch(0), trainer.batch_sharding))
  assert not np.isfinite(float(metrics["loss"]))
  assert int(new["step"]) == 0
  np.testing.assert_array_equal(np.asarray(new["params"]["blocks"]["mlp"]["up"]), before["blocks"]["mlp"]["up"])
