#!/usr/bin/env bash
# N processes of one mercury_jax command on this machine, joined by JAX's distributed runtime on a free localhost
# port: multi-host training and sampling without a cluster (on CPU: simulated devices and gloo collectives).
#
#   launch/local_multiprocess.sh [-n PROCESSES] [-d DEVICES_PER_PROCESS] [-l LOG_DIR] -- COMMAND [ARG ...]
#
#   launch/local_multiprocess.sh -n 2 -d 4 -- python -m mercury_jax.train --config tiny --workdir runs/mp \
#     --set data.path=data/stdlib
#
# Process I runs COMMAND with `--coordinator localhost:PORT --num-processes N --process-id I` appended; with -d it
# also gets JAX_PLATFORMS=cpu and XLA_FLAGS=--xla_force_host_platform_device_count=D. (On a multi-GPU machine give
# each process its GPUs instead, e.g. by running it with CUDA_VISIBLE_DEVICES set.) Each process writes
# LOG_DIR/process_I.log (default LOG_DIR: a new folder under ${TMPDIR:-/tmp}); process 0's log is shown as it runs.
#
# Ctrl-C (or SIGTERM to this script) sends SIGTERM to every process: training saves one checkpoint at a step all
# processes agree on and exits 0, and rerunning the same command resumes. A second Ctrl-C kills them. If a process
# fails, the others are killed 10 s later (they could only wait for it). Exit status: 0 when every process exits 0,
# else the status of the process that failed first.
set -euo pipefail

usage() {
  sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2
  exit 2
}

processes=2
devices=""
log_dir=""
while getopts "n:d:l:h" opt; do
  case "$opt" in
    n) processes="$OPTARG" ;;
    d) devices="$OPTARG" ;;
    l) log_dir="$OPTARG" ;;
    *) usage ;;
  esac
done
shift $((OPTIND - 1))
[[ "${1:-}" == "--" ]] && shift
(($# > 0)) || usage
if ! [[ "$processes" =~ ^[1-9][0-9]*$ ]]; then
  echo "local_multiprocess.sh: -n $processes must be a positive integer" >&2
  exit 2
fi
if [[ -n "$devices" && ! "$devices" =~ ^[1-9][0-9]*$ ]]; then
  echo "local_multiprocess.sh: -d $devices must be a positive integer" >&2
  exit 2
fi
log_dir="${log_dir:-$(mktemp -d "${TMPDIR:-/tmp}/mercury_multiprocess.XXXXXX")}"
mkdir -p "$log_dir"

# A port the kernel says is free now; process 0 binds it a moment later.
port="$(python3 -c 'import socket; s = socket.socket(); s.bind(("localhost", 0)); print(s.getsockname()[1])')"

pids=()
tail_pid=""
stopping=0

cleanup() {
  trap - INT TERM
  exec 2>/dev/null # Nothing more to say; this hides bash's "Killed" notices.
  for pid in "${pids[@]}"; do
    kill -KILL "$pid" 2>/dev/null || true
  done
  if [[ -n "$tail_pid" ]]; then
    kill "$tail_pid" 2>/dev/null || true
  fi
}

stop() {
  if ((stopping)); then
    echo "local_multiprocess.sh: killing all processes" >&2
    cleanup
    exit 130
  fi
  stopping=1
  echo "local_multiprocess.sh: SIGTERM to all $processes processes (they save and exit; again to kill)" >&2
  for pid in "${pids[@]}"; do
    kill -TERM "$pid" 2>/dev/null || true
  done
}

trap cleanup EXIT
trap stop INT TERM

for ((i = 0; i < processes; i++)); do
  environment=()
  if [[ -n "$devices" ]]; then
    environment=(JAX_PLATFORMS=cpu "XLA_FLAGS=${XLA_FLAGS:-} --xla_force_host_platform_device_count=$devices")
  fi
  # Background jobs of a script ignore SIGINT, so Ctrl-C reaches the processes only as the SIGTERM sent by stop().
  env "${environment[@]}" "$@" --coordinator "localhost:$port" --num-processes "$processes" --process-id "$i" \
    >"$log_dir/process_$i.log" 2>&1 &
  pids+=("$!")
done
echo "local_multiprocess.sh: $processes processes on localhost:$port, logs in $log_dir" >&2
tail -n +1 -f "$log_dir/process_0.log" &
tail_pid="$!"

statuses=()
remaining="$processes"
failed_at=""
exit_status=0
while ((remaining > 0)); do
  for i in "${!pids[@]}"; do
    [[ -n "${statuses[$i]:-}" ]] && continue
    if ! kill -0 "${pids[$i]}" 2>/dev/null; then
      status=0
      wait "${pids[$i]}" || status=$?
      statuses[i]="$status"
      remaining=$((remaining - 1))
      if ((status != 0)) && [[ -z "$failed_at" ]]; then
        echo "local_multiprocess.sh: process $i exited with status $status (log: $log_dir/process_$i.log)" >&2
        failed_at="$SECONDS"
        exit_status="$status"
      fi
    fi
  done
  if [[ -n "$failed_at" ]] && ((remaining > 0 && SECONDS - failed_at >= 10)); then
    for i in "${!pids[@]}"; do
      if [[ -z "${statuses[$i]:-}" ]]; then
        status=0
        { kill -KILL "${pids[$i]}" && wait "${pids[$i]}"; } 2>/dev/null || status=$? # No "Killed" notice.
        statuses[i]="$status"
        remaining=$((remaining - 1))
      fi
    done
  fi
  if ((remaining > 0)); then
    # In the background: a foreground `sleep` killed by Ctrl-C would make bash run the trap a second time.
    sleep 0.2 &
    wait "$!" || true
  fi
done

sleep 0.3 # Let tail print process 0's last lines.
if ((exit_status != 0)); then
  echo "local_multiprocess.sh: exit statuses by process: ${statuses[*]}; logs in $log_dir" >&2
fi
exit "$exit_status"
