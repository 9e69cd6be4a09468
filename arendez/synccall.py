"""How ``arendez.sync`` makes an async API call a blocking one, shaped as torch.distributed's:
positional arguments bound by torch's parameter order, ``async_op`` (a ``Work``), the outputs
its future holds, and stand-ins for the torch tensors arendez cannot carry as they are."""

from __future__ import annotations

import functools
import inspect
import sys as _sys
from collections.abc import Callable, Coroutine
from typing import Any

from .loop import shared
from .syncwork import Work

__all__ = ["blocking"]


#: Collectives that reduce: a bfloat16 tensor travels as a float32 copy in them (as its bits
#: in the others), as in the torch backend (``arendez.torchstage``).
_REDUCING = frozenset(
    {
        "all_reduce",
        "reduce",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "all_reduce_coalesced",
        "reduce_scatter_single",
    }
)


#: torch.distributed's parameters in order (torch 2.13), for the calls whose torch signature has
#: parameters the async API's lacks: positional arguments bind by torch's order, so
#: ``all_reduce(t, op, group, True)`` is an ``async_op``, as in torch.
_TORCH_PARAMS: dict[str, tuple[str, ...]] = {
    "all_reduce": ("tensor", "op", "group", "async_op"),
    "reduce": ("tensor", "dst", "op", "group", "async_op", "group_dst"),
    "broadcast": ("tensor", "src", "group", "async_op", "group_src"),
    "all_gather": ("tensor_list", "tensor", "group", "async_op"),
    "all_gather_into_tensor": ("output_tensor", "input_tensor", "group", "async_op"),
    "gather": ("tensor", "gather_list", "dst", "group", "async_op", "group_dst"),
    "scatter": ("tensor", "scatter_list", "src", "group", "async_op", "group_src"),
    "reduce_scatter": ("output", "input_list", "op", "group", "async_op"),
    "reduce_scatter_tensor": ("output", "input", "op", "group", "async_op"),
    "all_to_all": ("output_tensor_list", "input_tensor_list", "group", "async_op"),
    "all_to_all_single": ("output", "input", "output_split_sizes", "input_split_sizes", "group", "async_op"),
    "all_reduce_coalesced": ("tensors", "op", "group", "async_op"),
    "all_gather_coalesced": ("output_tensor_lists", "input_tensor_list", "group", "async_op"),
    "all_gather_single": ("output_tensor", "input_tensor", "group", "async_op"),
    "reduce_scatter_single": ("output", "input", "op", "group", "async_op"),
    "barrier": ("group", "async_op", "device_ids", "timeout"),
    "broadcast_object_list": ("object_list", "src", "group", "device", "group_src"),
    "recv_object_list": ("object_list", "src", "group", "device", "group_src", "use_batch"),
    "new_group": (
        "ranks", "timeout", "backend", "pg_options", "use_local_synchronization", "group_desc",
        "device_id", "sort_ranks",
    ),
}  # fmt: skip
#: what each torch-only parameter may be here (its default, or what changes nothing on CPU)
_TORCH_ONLY: dict[str, Callable[[Any], bool]] = {
    "device": lambda v: v is None or str(v) == "cpu",
    "device_id": lambda v: v is None or str(v) == "cpu",
    "device_ids": lambda v: v is None or isinstance(v, list),  # (CUDA devices; gloo ignores them)
    "pg_options": lambda v: v is None,
    "use_local_synchronization": lambda v: not v,  # (every rank calls new_group here)
    "group_desc": lambda v: v is None or isinstance(v, str),
    "sort_ranks": lambda v: bool(v),
    "use_batch": lambda v: not v,
}


#: the defaults of torch's parameters that the async API lacks
_TORCH_DEFAULTS: dict[str, Any] = {
    "async_op": False, "sort_ranks": True, "use_batch": False, "use_local_synchronization": False,
}  # fmt: skip


def torch_signature(fn: Callable[..., Any], names: tuple[str, ...]) -> inspect.Signature:
    """What ``help()`` shows for the blocking ``fn``: torch's parameters (``names``) in torch's
    order, with ``fn``'s defaults where it has them, then ``fn``'s own extras as keywords."""
    own = inspect.signature(fn).parameters
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    params = [
        own[n].replace(kind=kind) if n in own else inspect.Parameter(n, kind, default=_TORCH_DEFAULTS.get(n))
        for n in names
    ]
    extras = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for n, p in own.items() if n not in names]
    return inspect.Signature(params + extras)


def _first_torch_only(names: tuple[str, ...]) -> int:
    return next(i for i, n in enumerate(names) if n == "async_op" or n in _TORCH_ONLY)


def _as_torch(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], bool]:
    """Bind ``args`` by torch's parameter order into ``kwargs`` (in place) from the first
    parameter the async API lacks; return the positional rest and ``async_op``. A torch-only
    parameter that would change what the call does here is a ``ValueError`` naming it."""
    names = _TORCH_PARAMS[name]
    at = _first_torch_only(names)
    if len(args) > len(names):
        raise TypeError(f"{name}() takes at most {len(names)} positional arguments ({len(args)} given)")
    for param, value in zip(names[at:], args[at:], strict=False):
        if param in kwargs:
            raise TypeError(f"{name}() got multiple values for argument '{param}'")
        kwargs[param] = value
    async_op = bool(kwargs.pop("async_op", False))
    for param in _TORCH_ONLY.keys() & kwargs.keys():
        value = kwargs.pop(param)
        if not _TORCH_ONLY[param](value):
            raise ValueError(f"{name}(): {param}={value!r} is not supported by arendez (CPU; all ranks call)")
    return args[:at], async_op


def blocking(fn: Callable[..., Coroutine[Any, Any, Any]]) -> Callable[..., Any]:
    """``fn``, blocking: run on the shared loop thread, with torch's calling conventions."""
    name = fn.__name__
    reduces = name in _REDUCING
    objects = name.endswith("_object") or name.endswith("_object_list")  # (pickled as they are)
    names = _TORCH_PARAMS.get(name)
    at = _sys.maxsize if names is None else _first_torch_only(names)
    torch_only = {"async_op", *_TORCH_ONLY}

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        run = fn
        async_op = False
        if len(args) > at or (kwargs and not torch_only.isdisjoint(kwargs)):
            if names is None:
                async_op = bool(kwargs.pop("async_op", False))
            else:
                args, async_op = _as_torch(name, args, kwargs)
        outputs = _outputs(name, args, kwargs) if async_op else []  # (the caller's, not stand-ins)
        if "torch" in _sys.modules and not objects:  # (bfloat16, non-contiguous tensors: stand-ins)
            staged = _staged(fn, args, kwargs, reduces)
            if staged is not None:
                run, args, kwargs = staged
        if async_op:
            return Work(shared.start(run, args, kwargs), outputs)
        return shared.call(run, *args, **kwargs)

    if names is not None:
        call.__signature__ = torch_signature(fn, names)  # type: ignore[attr-defined]
    return call


def _is_data(value: Any) -> bool:
    """A tensor or array, or a list (of them, or of objects): what a collective writes."""
    return isinstance(value, list) or hasattr(value, "shape")


#: collectives whose future holds their output list itself (``[t0, t1]``), as gloo's does
_LISTED = frozenset({"all_gather", "all_to_all"})


def _outputs(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """What gloo's future of a collective holds: its first data argument (the tensor written),
    positional or by keyword (``broadcast(src=0, tensor=t)``), in a list; the output list itself
    for ``all_gather`` and ``all_to_all``; ``gather``'s gather list where it is given (the
    destination), else ``[]``; ``[]`` for a call without one (``barrier``)."""
    if name == "gather":
        listed = kwargs.get("gather_list", args[1] if len(args) > 1 else None)
        return list(listed) if listed is not None else []
    for value in (*args, *kwargs.values()):
        if _is_data(value):
            return value if name in _LISTED and isinstance(value, list) else [value]
    return []


#: arguments the collectives only read (their stand-ins are not copied back)
_READ_ONLY = frozenset({"input", "input_tensor", "input_list", "input_tensor_list", "scatter_list"})
_READ_ONLY_OF = {
    "send": frozenset({"tensor"}),
    "isend": frozenset({"tensor"}),
    "gather": frozenset({"tensor"}),
}


def _staged(
    fn: Callable[..., Coroutine[Any, Any, Any]], args: tuple[Any, ...], kwargs: dict[str, Any], widen: bool
) -> tuple[Callable[..., Coroutine[Any, Any, Any]], tuple[Any, ...], dict[str, Any]] | None:
    """The call with stand-ins for the torch tensors arendez cannot carry as they are (None if
    there are none); the stand-ins written are copied back when the call succeeds."""
    import torch

    from .torchstage import Stage, stand_in_needed

    def needs(v: Any) -> bool:
        return isinstance(v, torch.Tensor) and stand_in_needed(v)

    values = [*args, *kwargs.values()]
    if not any(needs(v) or (isinstance(v, list) and any(needs(t) for t in v)) for v in values):
        return None
    stage = Stage(widen=widen)
    bound = inspect.signature(fn).bind(*args, **kwargs).arguments
    read = _READ_ONLY | _READ_ONLY_OF.get(fn.__name__, frozenset())

    def swap(v: Any, out: bool) -> Any:
        if isinstance(v, torch.Tensor):
            return stage(v, out) if needs(v) else v
        if isinstance(v, list) and any(isinstance(t, torch.Tensor) for t in v):
            return [swap(t, out) for t in v]
        return v

    # only what the call writes is copied back: an input's stand-in written back over an output
    # that is a slice of it (an in-place reduce_scatter_tensor) undid the result
    staged = {name: swap(v, name not in read) for name, v in bound.items()}
    return functools.partial(stage.run, functools.partial(fn, **staged)), (), {}
