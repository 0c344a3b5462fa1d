#!/usr/bin/env bash
# Slurm Epilog: clean up after smstore when a job ends (see smstore-prolog.sh for the settings).
#
# By default the daemon stays, with its datasets loaded, for the next job on the node; set
# SMSTORE_STOP=1 to stop it (a shared node whose next job may be another user's). Either way,
# 'smstore gc' removes what a daemon that died (kill -9, out of memory) left in /dev/shm.
set -euo pipefail

env_file=${SMSTORE_SLURM_ENV:-/etc/smstore/slurm.env}
if [[ -r $env_file ]]; then
    # shellcheck source=/dev/null
    . "$env_file"
fi

say() { echo "smstore-epilog[job ${SLURM_JOB_ID:-?}]: $*" >&2; }

user=${SMSTORE_USER:-${SLURM_JOB_USER:-$(id -un)}}
socket=${SMSTORE_SOCKET:-/run/smstore-$user/smstore.sock}
export SMSTORE_SOCKET=$socket

as_user=()
if [[ $(id -u) == 0 && $user != "$(id -un)" ]]; then
    as_user=(runuser -u "$user" --)
fi

if [[ ${SMSTORE_STOP:-0} == 1 ]] && "${as_user[@]}" smstore status --json >/dev/null 2>&1; then
    "${as_user[@]}" smstore stop --timeout 30 >&2
    say "stopped the smstore daemon on $socket"
fi
"${as_user[@]}" smstore gc >&2
