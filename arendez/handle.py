"""The handle ``async with process_group(...) as pg`` yields: the API as methods of one object."""

from __future__ import annotations

from . import collectives, objects, p2p, registry


class Handle:
    """The default group's collectives and queries as methods (``await pg.all_reduce(x)``)."""

    get_rank = staticmethod(registry.get_rank)
    get_world_size = staticmethod(registry.get_world_size)
    get_process_group_ranks = staticmethod(registry.get_process_group_ranks)
    transport_stats = staticmethod(registry.transport_stats)
    barrier = staticmethod(collectives.barrier)
    all_reduce = staticmethod(collectives.all_reduce)
    reduce = staticmethod(collectives.reduce)
    broadcast = staticmethod(collectives.broadcast)
    all_gather = staticmethod(collectives.all_gather)
    all_gather_into_tensor = staticmethod(collectives.all_gather_into_tensor)
    gather = staticmethod(collectives.gather)
    scatter = staticmethod(collectives.scatter)
    reduce_scatter = staticmethod(collectives.reduce_scatter)
    reduce_scatter_tensor = staticmethod(collectives.reduce_scatter_tensor)
    all_to_all = staticmethod(collectives.all_to_all)
    all_to_all_single = staticmethod(collectives.all_to_all_single)
    all_gather_object = staticmethod(objects.all_gather_object)
    broadcast_object_list = staticmethod(objects.broadcast_object_list)
    gather_object = staticmethod(objects.gather_object)
    scatter_object_list = staticmethod(objects.scatter_object_list)
    send = staticmethod(p2p.send)
    recv = staticmethod(p2p.recv)

    @property
    def rank(self) -> int:
        """This process's rank in the default group."""
        return registry.get_rank()

    @property
    def world_size(self) -> int:
        """The default group's size."""
        return registry.get_world_size()
