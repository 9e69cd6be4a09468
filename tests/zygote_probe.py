"""A child for ``tests/test_zygote.py``: reports what it is, then ends as its argument says."""

from __future__ import annotations

import json
import os
import sys
import time

print(
    json.dumps(
        {
            "argv": sys.argv[1:],
            "probe": os.environ.get("PROBE"),
            "autoload": os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD"),
            "cwd": os.getcwd(),
            "arendez_imported": any(name.split(".")[0] == "arendez" for name in sys.modules),
            "own_session": os.getsid(0) == os.getpid(),
            "main": __name__,
        }
    ),
    flush=True,
)
if sys.argv[1] == "raise":
    raise RuntimeError("the probe fails as asked")
if sys.argv[1] == "sleep":
    time.sleep(60)
sys.exit(int(sys.argv[1]))
