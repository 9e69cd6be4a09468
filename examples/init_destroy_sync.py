"""Scenario 1, blocking: the torch.distributed script with only its import changed."""

import arendez.sync as dist

dist.init_process_group(backend="gloo", init_method=None, world_size=1, rank=0)
print("Group initialized:", dist.is_initialized())
dist.destroy_process_group()
print("Group destroyed; initialized:", dist.is_initialized())
