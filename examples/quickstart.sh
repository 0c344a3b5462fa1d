#!/usr/bin/env bash
# Quick start: pack the bundled corpus, serve it from the node daemon, train on 2 CPU ranks, resume.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python="${PYTHON:-python}"
export OMP_NUM_THREADS=1

# Everything this script creates lives in one temp dir (or $SMSTORE_RUN_DIR, which is kept): the
# blob, the checkpoint, the daemon's log, and the daemon's socket in a private (0700) subdirectory.
keep_run=""
if [[ -n "${SMSTORE_RUN_DIR:-}" ]]; then
    run="$SMSTORE_RUN_DIR"
    mkdir -p "$run"
    keep_run=1
else
    run="$(mktemp -d)"
fi
# Work from the run directory: from the repository root, `python -m smstore` would import the
# source tree (which has no compiled module) instead of the installed package.
cd "$run"
sock="$run/daemon/smstore.sock"
daemon_pid=""
job_pid=""

# Runs a step in the background and waits for it, so that a signal to this script runs the trap at
# once (bash defers traps until a foreground command ends) and the trap can stop the step too.
step() {
    "$@" &
    job_pid=$!
    wait "$job_pid"
    job_pid=""
}

# On any exit: stop a training step still running, then our daemon by its pid (SIGTERM: it unlinks
# its segments and socket; SIGKILL if it does not go, then gc removes what it left in /dev/shm);
# then the temp dir.
cleanup() {
    local status=$?
    trap - EXIT INT TERM
    if [[ -n "$job_pid" ]] && kill -0 "$job_pid" 2>/dev/null; then
        kill -TERM "$job_pid" 2>/dev/null || true # torchrun passes it on to its ranks
        wait "$job_pid" 2>/dev/null || true
    fi
    if [[ -n "$daemon_pid" ]] && kill -0 "$daemon_pid" 2>/dev/null; then
        kill -TERM "$daemon_pid" 2>/dev/null || true
        for _ in $(seq 50); do
            kill -0 "$daemon_pid" 2>/dev/null || break
            sleep 0.1
        done
        if kill -0 "$daemon_pid" 2>/dev/null; then
            kill -KILL "$daemon_pid" 2>/dev/null || true
        fi
        wait "$daemon_pid" 2>/dev/null || true
        "$python" -m smstore gc --socket "$sock" >/dev/null 2>&1 || true
    fi
    [[ -n "$keep_run" ]] || rm -rf "$run"
    exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

echo "== smstore pack: one record per line of the corpus"
"$python" -m smstore pack -q "$here/data/corpus.txt" -o "$run/corpus.smst"
"$python" -m smstore info "$run/corpus.smst"

echo "== smstore serve: one copy in /dev/shm for every rank and worker (log: $run/daemon.log)"
"$python" -m smstore serve --socket "$sock" "$run/corpus.smst" 2>"$run/daemon.log" &
daemon_pid=$!
ready=""
for _ in $(seq 100); do
    if ! kill -0 "$daemon_pid" 2>/dev/null; then
        cat "$run/daemon.log" >&2
        echo "quickstart: the daemon exited" >&2
        exit 1
    fi
    # Ready once it answers and lists the blob as loaded (no longer under "loading...").
    if out="$("$python" -m smstore status --socket "$sock" 2>/dev/null)" && grep -q "^  clients" <<<"$out" &&
        ! grep -q "loading\.\.\." <<<"$out"; then
        ready=1
        break
    fi
    sleep 0.1
done
if [[ -z "$ready" ]]; then
    cat "$run/daemon.log" >&2
    echo "quickstart: the daemon did not get ready" >&2
    exit 1
fi
echo "$out"

# python -m torch.distributed.run is torchrun for this interpreter; --standalone picks a free port.
echo "== train: 2 ranks (gloo, CPU), 2 DataLoader workers each, 20 steps, records from the daemon"
step "$python" -m torch.distributed.run --standalone --nproc-per-node=2 "$here/train.py" \
    --data "$run/corpus.smst" --mode daemon --socket "$sock" --steps 20 \
    --checkpoint "$run/checkpoint.pt" --log-every 5

echo "== resume from the checkpoint on 1 rank: the global order goes on where it stopped"
step "$python" -m torch.distributed.run --standalone --nproc-per-node=1 "$here/train.py" \
    --data "$run/corpus.smst" --mode daemon --socket "$sock" --steps 30 \
    --checkpoint "$run/checkpoint.pt" --log-every 5 --resume

echo "== smstore stop: the daemon removes its segment and socket"
"$python" -m smstore stop --socket "$sock"
wait "$daemon_pid" || true
daemon_pid=""
