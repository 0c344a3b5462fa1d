#!/usr/bin/env bash
# Quick start: pack the bundled corpus, train a byte-level LM on 2 CPU ranks, then resume it.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python="${PYTHON:-python}"
if [[ -n "${SMSTORE_RUN_DIR:-}" ]]; then
    run="$SMSTORE_RUN_DIR"
    mkdir -p "$run"
else
    run="$(mktemp -d)"
    trap 'rm -rf "$run"' EXIT
fi
export OMP_NUM_THREADS=1

echo "== smstore pack: one record per line of the corpus"
"$python" -m smstore pack "$here/data/corpus.txt" -o "$run/corpus.smst"
"$python" -m smstore info "$run/corpus.smst"

# python -m torch.distributed.run is torchrun for this interpreter; --standalone picks a free port.
echo "== train: 2 ranks (gloo, CPU), 2 DataLoader workers each, 20 steps"
"$python" -m torch.distributed.run --standalone --nproc-per-node=2 "$here/train.py" \
    --data "$run/corpus.smst" --steps 20 --checkpoint "$run/checkpoint.pt" --log-every 5

echo "== resume from the checkpoint on 1 rank: the global order goes on where it stopped"
"$python" -m torch.distributed.run --standalone --nproc-per-node=1 "$here/train.py" \
    --data "$run/corpus.smst" --steps 30 --checkpoint "$run/checkpoint.pt" --log-every 5 --resume
