"""The continuous family's solver: one step of the probability-flow ODE over token latents (the future step rule).

For the variance-exploding process of ``objectives.continuous`` (``z = e + sigma * eps``) the probability-flow ODE
(Song et al. 2021; Karras et al. 2022, EDM, eq. 1 with ``s = 1``) is

    dz / dsigma = -sigma * grad_z log p(z; sigma) = (z - D(z, sigma)) / sigma,

where ``D(z, sigma) = E_p[e]`` is the denoiser: the network's predicted distribution over clean tokens times the
latent table (score interpolation, ``continuous.score``). A block's latents start at ``z ~ N(0, (sigma_max^2 + 1)
I)`` (the marginal of normalised latents at sigma_max, to within a Gaussian approximation) and are carried down a
decreasing ladder of noise levels by Euler steps or Heun's second-order correction (EDM's Algorithm 1); at
``sigma_min`` the latents are projected to tokens by the last predicted distribution.

Every function here is one step, with no loop: the engine's ``fori_loop`` over steps is the only loop, as for every
other step rule. Each takes ``denoise: (z, sigma) -> D`` so the same code serves the network, guidance
(``D_guided = D_uncond + w (D_cond - D_uncond)``) and the exact denoiser of the tests.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from mercury_jax.config import ObjectiveConfig

Denoiser = Callable[[jax.Array, jax.Array], jax.Array]  # (z [..., d], sigma []) -> D(z, sigma) [..., d]
SOLVERS = ("euler", "heun")


def sigma_ladder(cfg: ObjectiveConfig, steps: int, rho: float = 7.0) -> jax.Array:
  """``steps + 1`` noise levels from ``sigma_max`` down to ``sigma_min`` (EDM's spacing: uniform in
  ``sigma^(1/rho)``, so steps are dense at low noise, where tokens are decided)."""
  if steps < 1:
    raise ValueError(f"steps={steps} must be >= 1")
  i = jnp.arange(steps + 1, dtype=jnp.float32) / steps
  hi, lo = cfg.sigma_max ** (1.0 / rho), cfg.sigma_min ** (1.0 / rho)
  return (hi + i * (lo - hi)) ** rho


def initial_latents(key: jax.Array, shape: tuple[int, ...], cfg: ObjectiveConfig) -> jax.Array:
  """Latents at ``sigma_max``: ``N(0, (sigma_max^2 + 1) I)``, ``shape = [..., d]``."""
  return jnp.sqrt(cfg.sigma_max**2 + 1.0) * jax.random.normal(key, shape)


def step(denoise: Denoiser, z: jax.Array, sigma: jax.Array, sigma_next: jax.Array, solver: str = "euler"):
  """One solver step of the probability-flow ODE from ``sigma`` to ``sigma_next`` (< ``sigma``).

  Args:
    denoise: ``(z, sigma) -> D(z, sigma)``, the denoiser's estimate of the clean latents.
    z: latents at ``sigma``, [..., d].
    sigma, sigma_next: scalars (traced or not).
    solver: ``euler`` (one denoiser call) or ``heun`` (two: Euler, then the trapezoid of the two slopes).

  Returns:
    The latents at ``sigma_next``.
  """
  if solver not in SOLVERS:
    raise ValueError(f"solver={solver!r} must be one of {SOLVERS}")
  slope = (z - denoise(z, sigma)) / sigma
  euler = z + (sigma_next - sigma) * slope
  if solver == "euler":
    return euler
  slope_next = (euler - denoise(euler, sigma_next)) / sigma_next
  return z + (sigma_next - sigma) * 0.5 * (slope + slope_next)
