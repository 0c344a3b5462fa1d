#!/usr/bin/env bash
# Slurm Prolog: make sure this node's smstore daemon serves the datasets before the job starts.
#
# slurm.conf: Prolog=/etc/slurm/smstore-prolog.sh (runs as root) and Epilog=.../smstore-epilog.sh.
# Settings come from the environment, or from $SMSTORE_SLURM_ENV (default /etc/smstore/slurm.env):
#   SMSTORE_DATASETS   blobs or sharded datasets to serve, separated by spaces (none: do nothing)
#   SMSTORE_USER       the user the daemon runs as, and serves (default: the job's, $SLURM_JOB_USER)
#   SMSTORE_SOCKET     its socket (default /run/smstore-$SMSTORE_USER/smstore.sock)
#   SMSTORE_SHM_LIMIT  its --shm-limit (default: none)
#   SMSTORE_WAIT       seconds to wait for the datasets to load (default 600)
#   SMSTORE_LOG        the daemon's log (default /var/log/smstore-$SMSTORE_USER.log)
# A non-zero exit fails the prolog: Slurm drains the node and requeues the job, and the reason is
# on stderr (slurmd's log) and in the daemon's log.
set -euo pipefail

env_file=${SMSTORE_SLURM_ENV:-/etc/smstore/slurm.env}
if [[ -r $env_file ]]; then
    # shellcheck source=/dev/null
    . "$env_file"
fi

say() { echo "smstore-prolog[job ${SLURM_JOB_ID:-?}]: $*" >&2; }

read -r -a datasets <<<"${SMSTORE_DATASETS:-}"
if ((${#datasets[@]} == 0)); then
    exit 0
fi
user=${SMSTORE_USER:-${SLURM_JOB_USER:-$(id -un)}}
socket=${SMSTORE_SOCKET:-/run/smstore-$user/smstore.sock}
wait_s=${SMSTORE_WAIT:-600}
logfile=${SMSTORE_LOG:-/var/log/smstore-$user.log}
export SMSTORE_SOCKET=$socket

# As root (slurmd's Prolog), run smstore as the daemon's user; as that user, run it directly.
as_user=()
if [[ $(id -u) == 0 && $user != "$(id -un)" ]]; then
    as_user=(runuser -u "$user" --)
fi

if "${as_user[@]}" smstore status --json >/dev/null 2>&1; then
    # A daemon serves already (an earlier job's): loading a dataset it holds costs nothing.
    "${as_user[@]}" smstore load "${datasets[@]}" >&2
else
    "${as_user[@]}" smstore gc >&2 || true # what a daemon that died left behind
    dir=$(dirname "$socket")
    if [[ ! -d $dir ]]; then
        install -d -m 0700 -o "$user" "$dir"
    fi
    limit=()
    if [[ -n ${SMSTORE_SHM_LIMIT:-} ]]; then
        limit=(--shm-limit "$SMSTORE_SHM_LIMIT")
    fi
    say "starting the smstore daemon on $socket (log: $logfile)"
    setsid "${as_user[@]}" smstore serve --require "${limit[@]}" "${datasets[@]}" \
        >>"$logfile" 2>&1 </dev/null &
    daemon=$!
fi

deadline=$((SECONDS + wait_s))
until "${as_user[@]}" smstore wait --timeout 2 "${datasets[@]}" >/dev/null 2>&1; do
    if [[ -n ${daemon:-} ]] && ! kill -0 "$daemon" 2>/dev/null; then
        say "the smstore daemon exited before serving ${datasets[*]}:"
        tail -n 5 "$logfile" >&2
        exit 1
    fi
    if ((SECONDS >= deadline)); then
        say "${datasets[*]} not served after ${wait_s} s; see 'smstore status' and $logfile"
        exit 1
    fi
done
say "serving ${datasets[*]} on $socket"
