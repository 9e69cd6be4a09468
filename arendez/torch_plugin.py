"""torch's plugin hook: the ``torch.backends`` entry point registers backend ``"arendez"`` and the
``arendez://`` init method while ``import torch`` runs, so ``init_process_group("arendez")``
works with no ``import arendez.torch``.

Both registrations are lazy: ``arendez.torch`` is imported only when torch first creates an
arendez process group or resolves an ``arendez://`` URL. Nothing here may raise: a failing hook
would make ``import torch`` fail for everyone who has arendez installed.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Iterator
from typing import Any

log = logging.getLogger("arendez")

BACKEND = "arendez"


def autoload() -> None:
    """Register ``"arendez"`` with torch.distributed, if it is available and not yet registered."""
    try:
        import torch.distributed as dist

        if not dist.is_available():
            return
        if BACKEND.upper() not in dist.Backend._plugins:
            dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])
        rendezvous: Any = importlib.import_module("torch.distributed.rendezvous")
        rendezvous.register_rendezvous_handler(BACKEND, _rendezvous)
    except Exception as exc:  # never break `import torch`
        log.debug("arendez: torch plugin not registered: %s", exc)


def _create(*args: Any, **kwargs: Any) -> Any:
    from . import torch as backend

    return backend._create(*args, **kwargs)


def _rendezvous(url: str, *args: Any, **kwargs: Any) -> Iterator[tuple[Any, int, int]]:
    from .torchstore import arendez_rendezvous

    importlib.import_module("arendez.torch")  # the backend's own registration, before torch needs it
    return arendez_rendezvous(url, *args, **kwargs)
