"""``arendez.sync.init_process_group(store=TCPStore(...))`` as torch scripts write it:
``python sync_store_init.py RANK PORT PREFIX`` (PREFIX ``-``: the TCPStore itself, else a
PrefixStore over it); prints one JSON line with the sum and the store's check of a key."""

import datetime
import json
import sys

import numpy as np

import arendez.sync as dist

rank, port, prefix = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, datetime.timedelta(seconds=20))
if prefix != "-":
    store = dist.PrefixStore(prefix, store)
dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=20)
x = np.full(4, rank + 1.0, np.float32)
dist.all_reduce(x)
dist.destroy_process_group()  # the store goes on without the world (as torch's)
store.set(f"done-{rank}", "1")
store.wait([f"done-{1 - rank}"])
store.multi_set([f"m{rank}"], ["v"])
seen = store.multi_get([f"done-{1 - rank}"])[0].decode()
store.set(f"bye-{rank}", "1")
if rank == 0:
    store.wait(["bye-1"])  # the master's process serves the store: it ends last
print(json.dumps({"sum": float(x[0]), "seen": seen}), flush=True)
