"""Elastic exit-status script (no collectives): slot 1 fails at once; its replacement fails only
after the other slots have finished (a replacement that came too late); or, with ``--original``,
slot 1 never fails early and fails after the others finished (a failure that counts)."""

import os
import sys
import time

slot, restart = int(os.environ["LOCAL_RANK"]), int(os.environ.get("ARENDEZ_RESTART_COUNT", "0"))
if slot != 1:
    time.sleep(0.3)
    sys.exit(0)
if "--original" in sys.argv or restart:
    time.sleep(1.5)
    sys.exit(5)
sys.exit(3)
