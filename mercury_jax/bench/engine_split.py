"""What the serving benchmark reads of a server's ``/metrics`` beyond the client's clock: the engine thread's time per
step by phase, the event loop's share, the device work priced bare or in place (``python -m mercury_jax.bench serve
--price``), and the compile pool's fairness probe (``--fairness``)."""

from __future__ import annotations

import asyncio
import re
import time

from mercury_jax.bench.serving import COUNTERS, num

PHASES = ("admit", "dispatch", "wait", "report", "post")  # mercury_engine_phase_seconds_total{phase}
SAMPLE = re.compile(r'^(mercury_\w+)(?:\{(\w+)="([^"]*)"\})? (\S+)$')


async def counters(client, url: str) -> dict:
  """The server's ``/metrics`` samples of ``mercury_*`` families: ``name -> value``, and ``name -> {label value:
  value}`` for the one-label families (phases, steps by rows, prefills by slots); an older server lacks some."""
  try:
    text = (await client.get(f"{url}/metrics")).text
  except Exception:
    return {}
  found: dict = {}
  for line in text.splitlines():
    match = SAMPLE.match(line)
    if match is None:
      continue
    name, label, value = match.group(1), match.group(3), float(match.group(4))
    if match.group(2) is None:
      found[name] = value
    elif match.group(2) in ("phase", "rows", "slots", "le"):
      found.setdefault(name, {})[label] = value
  return found


def _delta(before: dict, after: dict, name: str):
  """``after - before`` of a sample (a dict of them for a labelled family); None when either lacks it."""
  if name not in before and name not in after:
    return None
  a, b = after.get(name, {}), before.get(name, {})
  if isinstance(a, dict):
    return {key: a[key] - b.get(key, 0.0) for key in a}
  return a - b


def engine_split(before: dict, after: dict) -> dict:
  """Engine ms per step, the host's share of it, and its phases in ms per step over a level (None without the
  counters); the step and prefill counts, for :func:`price`."""
  names = COUNTERS[1:]
  if not all(n in before and n in after for n in names):
    return {"engine_steps": None, "step_ms": None, "host_share": None}
  steps, engine, host = (after[n] - before[n] for n in names)
  if steps < 1:
    return {"engine_steps": 0, "step_ms": None, "host_share": None}
  out = {"engine_steps": steps, "step_ms": 1000 * (engine + host) / steps, "host_share": host / (engine + host)}
  phases = _delta(before, after, "mercury_engine_phase_seconds_total")
  if phases:
    out["phases_ms"] = {phase: 1000 * phases.get(phase, 0.0) / steps for phase in PHASES}
    out["step_ms"] = sum(out["phases_ms"].values())  # every second of the engine thread, by phase
  answer = _delta(before, after, "mercury_answer_seconds_total")
  if answer is not None:
    out["answer_ms"] = 1000 * answer / steps
  out["steps_by_rows"] = _delta(before, after, "mercury_engine_steps_total")
  out["prefills_by_slots"] = _delta(before, after, "mercury_prefills_total")
  timed = _delta(before, after, "mercury_engine_timed_steps_total")
  timed_s = _delta(before, after, "mercury_engine_timed_step_seconds_total")
  if timed and out["steps_by_rows"]:  # the device work priced at the timed iterations' times, in place
    mean = {int(float(rows)): timed_s[rows] / n for rows, n in timed.items() if n}
    if mean:
      # A bucket no timed iteration ran is priced at the nearest smaller one's time (else the nearest larger one's):
      # its device work is not overstated, so neither is the engine's time over it understated.
      below = lambda rows: max((r for r in mean if r <= rows), default=min(mean))  # noqa: E731
      priced = sum(n * mean[below(int(float(r)))] for r, n in out["steps_by_rows"].items() if n)
      out["timed_step_ms"] = 1000 * priced / steps
      prefills = _delta(before, after, "mercury_engine_timed_prefills_total") or 0
      seconds = _delta(before, after, "mercury_engine_timed_prefill_seconds_total") or 0.0
      count = sum((out["prefills_by_slots"] or {}).values())
      out["timed_prefill_ms"] = 1000 * count * seconds / prefills / steps if prefills else 0.0
      out["over_timed"] = out["step_ms"] / (out["timed_step_ms"] + out["timed_prefill_ms"])
  lag_sum = _delta(before, after, "mercury_event_loop_lag_seconds_sum")
  lag_count = _delta(before, after, "mercury_event_loop_lag_seconds_count")
  if lag_sum is not None and lag_count:
    out["loop_lag_ms"] = 1000 * lag_sum / lag_count
  return out


def price(row: dict, bare_steps: dict[int, float], bare_prefills: dict[int, float]) -> None:
  """Adds to a level's ``row`` the device work its engine did, priced at each program's bare time (ms per step: its
  steps by batch bucket and prefills by prefill bucket, over its steps), and the engine's time over it."""
  steps, prefills = row.get("steps_by_rows"), row.get("prefills_by_slots")
  if not steps or not row.get("engine_steps"):
    return
  unpriced = [int(float(k)) for k, n in prefills.items() if n and int(float(k)) not in bare_prefills]
  step_ms = sum(n * bare_steps[int(float(k))] for k, n in steps.items()) / row["engine_steps"]
  prefill_ms = sum(n * bare_prefills.get(int(float(k)), 0.0) for k, n in prefills.items()) / row["engine_steps"]
  row["bare_step_ms"], row["bare_prefill_ms"] = step_ms, prefill_ms
  row["over_bare"] = row["step_ms"] / (step_ms + prefill_ms)
  if unpriced:
    row["unpriced_prefills"] = unpriced  # chunked prefills (0): their chunks are in dispatch, not priced here


def price_levels(checkpoint: str, slots: int, levels: list[dict]) -> dict:
  """Times the server's programs bare (:func:`mercury_jax.bench.slot_step.bare_costs`, in this process while the
  server idles) and prices every level's engine work with them (:func:`price`)."""
  from mercury_jax.bench.slot_step import bare_costs
  from mercury_jax.sampling.sampler import Sampler

  print("  timing the steps and prefills bare (the server idles)", flush=True)
  steps, prefills = bare_costs(Sampler.from_checkpoint(checkpoint), slots)
  for row in levels:
    price(row, steps, prefills)
    if "over_bare" in row:
      print(
        f"  concurrency {row['concurrency']}: engine {row['step_ms']:.1f} ms/step against "
        f"{row['bare_step_ms']:.1f} ms of bare steps and {row['bare_prefill_ms']:.1f} ms of bare prefills: "
        f"{row['over_bare']:.3f}x",
        flush=True,
      )
  return {"step_ms": steps, "prefill_ms": prefills}


def breakdown_table(models: dict) -> str:
  """The engine thread's time per step by phase, the event loop's, and the engine's time over its bare work."""
  head = (
    "| model | conc. | engine ms/step | admit | dispatch | wait | report | post | answers (loop) | loop lag ms "
    "| in place: step + prefill ms | engine / in place | bare: step + prefill ms | engine / bare |"
  )
  lines = [head, "|" + "---|" * 14]
  for name, model in models.items():
    for row in model.get("levels", []):
      phases = row.get("phases_ms")
      if not phases:
        continue
      bare, timed = row.get("bare_step_ms"), row.get("timed_step_ms")
      priced = "-" if bare is None else f"{bare:.1f} + {row['bare_prefill_ms']:.1f}"
      in_place = "-" if timed is None else f"{timed:.1f} + {row['timed_prefill_ms']:.1f}"
      lines.append(
        f"| {name} | {row['concurrency']} | {row['step_ms']:.1f} | "
        + " | ".join(f"{phases[p]:.2f}" for p in PHASES)
        + f" | {num(row.get('answer_ms'), 2)} | {num(row.get('loop_lag_ms'), 2)} | {in_place} "
        f"| {num(row.get('over_timed'), 3)} | {priced} | {num(row.get('over_bare'), 3)} |"
      )
  return "\n".join(lines) if len(lines) > 2 else ""


def hostile_schema(i: int) -> dict:
  """A schema whose compile runs past a few seconds (a different one each, so no cache or shared job helps): a
  ``oneOf`` of 800 object branches, each pair of which the compiler checks for overlap before writing it as an
  ``anyOf`` (about 320,000 checks; integer bounds, which once made a slow input, now compile in milliseconds)."""
  return {
    "oneOf": [
      {"type": "object", "properties": {f"k{k}": {"type": "integer", "minimum": i + k}}, "required": [f"k{k}"]}
      for k in range(800)
    ]
  }


async def fairness(client, url: str, count: int) -> dict:
  """``count`` structured requests with :func:`hostile_schema`, then (0.1 s later) one with ``{"type": "boolean"}``:
  seconds to the boolean's whole answer, and each hostile request's status and seconds. A boolean schema alone first
  (another description, so neither is cached) gives the same answer's seconds on the same host without them."""

  async def ask(schema: dict) -> tuple[int, float, str]:
    body = {
      "prompt": "answer = ",
      "max_tokens": 4,
      "temperature": 0,
      "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    }
    began = time.perf_counter()
    response = await client.post(f"{url}/v1/completions", json=body)
    text = response.json()["choices"][0]["text"] if response.status_code == 200 else response.text[:200]
    return response.status_code, time.perf_counter() - began, text

  _, alone, _ = await ask({"type": "boolean", "description": "alone"})
  slow = [asyncio.create_task(ask(hostile_schema(i))) for i in range(count)]
  await asyncio.sleep(0.1)
  status, seconds, text = await ask({"type": "boolean"})
  pending = sum(not task.done() for task in slow)
  outcomes = await asyncio.gather(*slow)
  again = [await ask(hostile_schema(i)) for i in range(min(count, 2))]  # known to time out: from the cache
  out = {
    "hostile_count": count,
    "boolean_status": status,
    "boolean_s": seconds,
    "boolean_alone_s": alone,
    "boolean_text": text,
    "hostile_pending_when_answered": pending,
    "hostile": [{"status": c, "seconds": t} for c, t, _ in outcomes],
    "hostile_again_s": [t for _, t, _ in again],
  }
  print(
    f"  fairness: the boolean schema answered {status} in {seconds:.3f} s ({text!r}; alone {alone:.3f} s) with "
    f"{pending} of {count} hostile schemas still compiling; those answered {sorted({c for c, _, _ in outcomes})} in "
    f"{min(t for _, t, _ in outcomes):.1f}-{max(t for _, t, _ in outcomes):.1f} s, again in "
    f"{', '.join(f'{t:.3f}' for _, t, _ in again)} s",
    flush=True,
  )
  return out
