"""An elastic world through the blocking facade: init, share_state, reform, destroy."""

from __future__ import annotations

import json
import sys

import numpy as np

import arendez.sync as dist

dist.init_process_group(init_method=sys.argv[1], world_size=(2, 2), timeout=20)
me = dist.get_rank()
got = dist.share_state({"w": np.full(3, 1.0 + me), "step": 5} if me == 0 else None)
rank, size = dist.reform(timeout=10)
waiting = dist.joiners_waiting()
print(json.dumps({"before": me, "after": [rank, size], "w": got["w"].tolist(), "waiting": waiting}))
dist.destroy_process_group()
