#!/usr/bin/env bash
# Train and sample on a Cloud TPU pod slice (several TPU VM hosts) with the single-machine commands: this script
# runs them on every worker through `gcloud compute tpus tpu-vm ssh --worker=all`, and JAX finds the slice's other
# hosts by itself (from the TPU metadata server), so there are no --coordinator flags. Run it on your workstation.
#
#   launch/tpu_pod.sh create        # a v5litepod-16 slice: 4 hosts x 4 chips (see the settings below)
#   launch/tpu_pod.sh setup         # copy this checkout to every worker, pip install -e ".[tpu]", mount $NFS
#   launch/tpu_pod.sh train --config pod64_1b --workdir /mnt/shared/runs/1b --set data.path=/mnt/shared/data/stdlib
#   launch/tpu_pod.sh logs          # follow worker 0's training log
#   launch/tpu_pod.sh stop          # SIGTERM on every worker: one checkpoint at the same step, clean exit
#   launch/tpu_pod.sh train ...     # the same train command again resumes from the latest checkpoint
#   launch/tpu_pod.sh sample --checkpoint /mnt/shared/runs/1b --prompt 'def fibonacci(n):' --steps 16
#   launch/tpu_pod.sh run 'nproc; python3 -c "import jax; print(jax.device_count())"'   # any command, every worker
#   launch/tpu_pod.sh delete
#
# Settings (environment variables, defaults in brackets): TPU_NAME [mercury], ZONE [us-central1-a], ACCELERATOR
# [v5litepod-16], RUNTIME [v2-alpha-tpuv5-lite], PROJECT [gcloud's default project], SPOT [0; 1 makes `create` ask
# for spot capacity], NFS [empty; HOST:/EXPORT of a Filestore instance or other NFS share in the same VPC, which
# `setup` mounts at /mnt/shared on every worker].
#
# The workdir must be on storage every worker sees at the same path (each host writes its own shards of every
# checkpoint; train stops with one line if it is not shared), and data.path must hold the same prepared data on every
# worker: prepare it once (`python -m mercury_jax.prepare ... --out /mnt/shared/data/stdlib`) on the share.
# The whole slice is one training job: SIGTERM to the trainer on any worker (maintenance, spot preemption, `stop`)
# makes every worker save the same step and exit 0.
set -euo pipefail

TPU_NAME="${TPU_NAME:-mercury}"
ZONE="${ZONE:-us-central1-a}"
ACCELERATOR="${ACCELERATOR:-v5litepod-16}"
RUNTIME="${RUNTIME:-v2-alpha-tpuv5-lite}"
PROJECT="${PROJECT:-}"
SPOT="${SPOT:-0}"
NFS="${NFS:-}"
REMOTE_DIR="mercury_jax"   # Relative to the home directory on each worker.
LOG_DIR="mercury_logs"

gcloud_tpu=(gcloud compute tpus tpu-vm)
where=(--zone "$ZONE")
if [[ -n "$PROJECT" ]]; then
  where+=(--project "$PROJECT")
fi

usage() {
  sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2
  exit 2
}

# Runs a shell command line on every worker of the slice, all at once.
on_all_workers() {
  "${gcloud_tpu[@]}" ssh "$TPU_NAME" "${where[@]}" --worker=all --command "$1"
}

# Quotes arguments for the remote shell.
quoted() {
  local out=""
  for arg in "$@"; do
    out+=" $(printf '%q' "$arg")"
  done
  printf '%s' "$out"
}

(($# > 0)) || usage
action="$1"
shift
case "$action" in
  create)
    spot=()
    if [[ "$SPOT" == 1 ]]; then
      spot=(--spot)
    fi
    # ${spot[@]+...}: an empty array under `set -u` in the bash 3.2 of macOS.
    "${gcloud_tpu[@]}" create "$TPU_NAME" "${where[@]}" --accelerator-type "$ACCELERATOR" --version "$RUNTIME" \
      ${spot[@]+"${spot[@]}"}
    ;;
  setup)
    repo="$(cd "$(dirname "$0")/.." && pwd)"
    staging="$(mktemp -d)"
    archive="$staging/mercury_jax.tgz"
    trap 'rm -rf "$staging"' EXIT
    # Tracked and untracked files that git does not ignore: what you see in your checkout, without runs/ or data/.
    git -C "$repo" ls-files -z --cached --others --exclude-standard | tar -czf "$archive" -C "$repo" --null -T -
    "${gcloud_tpu[@]}" scp "$archive" "$TPU_NAME:mercury_jax.tgz" "${where[@]}" --worker=all
    on_all_workers "set -e; rm -rf ~/$REMOTE_DIR; mkdir -p ~/$REMOTE_DIR ~/$LOG_DIR
      tar -xzf ~/mercury_jax.tgz -C ~/$REMOTE_DIR
      cd ~/$REMOTE_DIR && python3 -m pip install --quiet --upgrade pip && python3 -m pip install --quiet -e '.[tpu]'"
    if [[ -n "$NFS" ]]; then
      on_all_workers "set -e; mountpoint -q /mnt/shared && exit 0
        sudo apt-get -qq update && sudo apt-get -qq install -y nfs-common
        sudo mkdir -p /mnt/shared && sudo mount -t nfs -o rw,hard $(printf '%q' "$NFS") /mnt/shared
        sudo chmod a+rwx /mnt/shared"
    fi
    on_all_workers "cd ~/$REMOTE_DIR && python3 -c 'import jax, mercury_jax; print(\"jax\", jax.__version__)'"
    ;;
  train)
    (($# > 0)) || usage
    # Detached with nohup, so a dropped ssh session does not stop training; one log and pid file per worker.
    on_all_workers "cd ~/$REMOTE_DIR && mkdir -p ~/$LOG_DIR || exit 1
      nohup python3 -m mercury_jax.train$(quoted "$@") > ~/$LOG_DIR/train.log 2>&1 < /dev/null &
      echo \$! > ~/$LOG_DIR/train.pid; echo \"\$(hostname): started, log ~/$LOG_DIR/train.log\""
    ;;
  logs)
    "${gcloud_tpu[@]}" ssh "$TPU_NAME" "${where[@]}" --worker=0 --command "tail -n 50 -F ~/$LOG_DIR/train.log"
    ;;
  stop)
    on_all_workers "pid=\$(cat ~/$LOG_DIR/train.pid 2>/dev/null) && kill -TERM \"\$pid\" 2>/dev/null &&
      echo \"\$(hostname): SIGTERM sent\" || echo \"\$(hostname): no training running\""
    ;;
  sample)
    (($# > 0)) || usage
    # In the foreground on every worker; only process 0 prints the samples.
    on_all_workers "cd ~/$REMOTE_DIR && python3 -m mercury_jax.sample$(quoted "$@")"
    ;;
  run)
    (($# == 1)) || usage
    on_all_workers "$1"
    ;;
  delete)
    "${gcloud_tpu[@]}" delete "$TPU_NAME" "${where[@]}" --quiet
    ;;
  *)
    usage
    ;;
esac
