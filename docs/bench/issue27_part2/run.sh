#!/usr/bin/env bash
# Issue 27 part 2: the continuous default-shape model (step 274) against the bundled pair.
set -x
cd "$(dirname "$0")/../../.."
D=RUNS/data/code
OUT=docs/bench/issue27_part2
mkdir -p $OUT
for m in; do :; done; for m in ; do
  n=$(basename $m)
  python -m mercury_jax.evaluate --checkpoint $m --data $D --max-batches 8 --t-samples 1 --batch-size 16 --json $OUT/eval_$n.json 2>&1 | grep -v WARNING | tail -3
done
RUNS/corpus-venv/bin/python -m mercury_jax.bench --diffusion RUNS/default_continuous --autoregressive mercury_jax/assets/default_ar --data $D \
  --out $OUT/continuous --prompts 32 --length 64 --steps 64,128,256,512 --temperatures 1.0 --ar-temperatures 1.0 \
  --batch-sizes 1 --repeats 1 2>&1 | grep -v WARNING | tail -30
RUNS/corpus-venv/bin/python -m mercury_jax.bench --diffusion mercury_jax/assets/default_bd --autoregressive mercury_jax/assets/default_ar --data $D \
  --out $OUT/block_diffusion --prompts 32 --length 64 --steps 16,32,64 --taus 0.9 --temperatures 1.0 --ar-temperatures 1.0 \
  --batch-sizes 1 --repeats 1 2>&1 | grep -v WARNING | tail -30
