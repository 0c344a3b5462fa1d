"""smstore's benchmarks: ``python -m benchmarks`` (run.py) and the scripts beside it (README.md)."""

import sys
from pathlib import Path

# `python -m benchmarks` in a checkout puts the checkout first on sys.path, where smstore/ holds
# only sources unless it was installed in place (pip install -e .). Then read the installed
# smstore (pip install .) and keep the checkout, last, for this package.
_root = Path(__file__).resolve().parent.parent
if not any((_root / "smstore").glob("_core*.so")):
    _here = {str(_root), ".", ""}
    sys.path[:] = [p for p in sys.path if (str(Path(p).resolve()) if p else "") not in _here] + [str(_root)]
