#!/usr/bin/env bash
# Everything GPU-specific, checked and timed in one go on one GPU host (docs/results/gpu.md has the last run):
#   correctness  the `gpu` tests: the flash-attention, cached-attention (dense and paged) and verified-mask kernels
#                compiled for the device against their references, and attend()'s pallas / cudnn paths
#   train        bf16 training steps/s and MFU of the default shape and of gpu8_125m's per-GPU shard
#                (python -m mercury_jax.bench train)
#   sample       the bundled models' sampling tokens/s by batch size, dtype and attention implementation
#                (python -m mercury_jax.bench gpu-sampling)
#   attention    flash attention TFLOP/s against XLA, cuDNN and JAX's bundled Pallas kernel, and the cache reads
#                (python -m mercury_jax.bench gpu-attention)
#   levers       verified decoding's draft trees against the twin at batch 1, where a chunk position costs little
#                (python -m mercury_jax.bench compare --levers; docs/bench/levers/README.md has the CPU's)
#
#   launch/gpu_checks.sh [OUT_DIR] [PART ...]     # default: every part, logs and JSON into OUT_DIR (default gpu_out)
#
# The host needs this package's dependencies for training and sampling (jax with its GPU plugin, flax, optax,
# orbax-checkpoint, grain, array_record, sentencepiece, pytest, pytest-timeout). An image that lacks some (the lent
# H200 lacked grain, array_record and portpicker) takes them as wheels downloaded on another machine:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#     --platform manylinux_2_28_x86_64 -d wheels grain==0.2.18 array_record==0.8.6 portpicker==1.6.0
#   pip install --no-index --no-deps --target /tmp/site wheels/*.whl && export PYTHONPATH=/tmp/site
# Set XLA_PYTHON_CLIENT_PREALLOCATE=false to share the GPU with another job (a training run beside the tests).
#
# Each part runs under its own time limit (seconds: CORRECTNESS_S, TRAIN_S, SAMPLE_S, ATTENTION_S, LEVERS_S), so one
# that hangs or fails costs its limit, not the rest of a timed session; a summary line per part ends the output.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu_out}
shift || true
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(correctness train sample attention levers)
mkdir -p "$out"
PYTHON=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=${JAX_PLATFORMS:-cuda} PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
summary=()

run_part() {  # name limit command...
  local name=$1 limit=$2 start=$SECONDS rc
  shift 2
  echo "=== $name: $* (limit ${limit} s, $(date +%T))"
  timeout -k 10 "$limit" "$@" 2>&1 | tee "$out/$name.log"
  rc=${PIPESTATUS[0]}
  summary+=("$name: exit $rc after $((SECONDS - start)) s")
  echo "=== $name: exit $rc after $((SECONDS - start)) s"
}

for part in "${parts[@]}"; do
  case $part in
    correctness)
      # conftest's quick-compilation flags are for XLA:CPU; naming the optimisation level keeps XLA's defaults here.
      # One test process compiles Triton too slowly for the 58 tests (28 in 200 s); 8 sharing the GPU took 114 s.
      XLA_FLAGS="--xla_backend_optimization_level=3" XLA_PYTHON_CLIENT_PREALLOCATE=false \
        run_part correctness "${CORRECTNESS_S:-240}" "$PYTHON" -m pytest -v --tb=line -m gpu -o addopts="" \
        -p no:cacheprovider --timeout 120 -rfE -n "${CORRECTNESS_PROCS:-8}" \
        tests/test_kernels.py tests/test_cached_attention.py tests/test_verified_mask.py
      ;;
    train)
      # bf16: the default shape with the Pallas kernel and with XLA's attention; gpu8_125m's per-GPU shard (its batch
      # of 128 over 8 GPUs) with the Pallas kernel and with cuDNN.
      run_part train "${TRAIN_S:-200}" bash -c "
        $PYTHON -m mercury_jax.bench train --config default --steps 20 --set model.dtype=bfloat16 \\
          --json $out/train.jsonl
        $PYTHON -m mercury_jax.bench train --config default --steps 20 --set model.dtype=bfloat16 \\
          --set model.attention=xla --json $out/train.jsonl
        $PYTHON -m mercury_jax.bench train --config gpu8_125m --steps 10 --set mesh.fsdp=1 --set data.batch_size=16 \\
          --json $out/train.jsonl
        $PYTHON -m mercury_jax.bench train --config gpu8_125m --steps 10 --set mesh.fsdp=1 --set data.batch_size=16 \\
          --set model.attention=cudnn --json $out/train.jsonl"
      ;;
    sample)
      run_part sample "${SAMPLE_S:-200}" "$PYTHON" -m mercury_jax.bench gpu-sampling --dtypes bfloat16 \
        --attention pallas,xla --batch-sizes 1,256 --length 128 --repeats 2 --json "$out/sample.json"
      ;;
    attention)
      run_part attention "${ATTENTION_S:-200}" "$PYTHON" -m mercury_jax.bench gpu-attention --quick \
        --skip-correctness --cached --budget-s 60 --json "$out/attention.json"
      ;;
    levers)
      run_part levers "${LEVERS_S:-420}" "$PYTHON" -m mercury_jax.bench compare --verified mercury_jax/assets/default \
        --autoregressive mercury_jax/assets/default_ar --data mercury_jax/assets/default --corpus python-stdlib \
        --no-diffusion --levers auto,chain,tree,tree-blocks,alternatives --prompts 32 --length 64 --batch-sizes 1 \
        --ar-temperatures 1,0 --out "$out/levers"
      ;;
    *)
      echo "unknown part $part: choose from correctness train sample attention levers" >&2
      exit 2
      ;;
  esac
done
printf '%s\n' "${summary[@]}"
