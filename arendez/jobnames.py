"""The job names arendez makes up when the user names none, and the stable label of each.

The torch backend gives every world it forms a job of its own on the store server it hosts
(``torch-<12 hex>``), and ``arendez-run`` one per launch (``run-<pid>-<6 hex>``). Files named
after a job (the flight recorder's dumps) use ``label``: the kind of a made-up name (``torch``,
``run``), so each run overwrites the last one's files as torch's own dumps do, rather than
leaving a new set in the temp dir every run; a job the user named keeps its name.
"""

from __future__ import annotations

import re
import secrets

_MADE_UP = re.compile(r"(torch)-[0-9a-f]{12}|(run)-[0-9]+-[0-9a-f]{6}")


def for_torch() -> str:
    """A new job name for a world the torch backend forms through a store."""
    return f"torch-{secrets.token_hex(6)}"


def for_launch(pid: int) -> str:
    """A new job name for one launch of ``arendez-run`` by the process ``pid``."""
    return f"run-{pid}-{secrets.token_hex(3)}"


def label(job: str) -> str:
    """``job``, or its kind if arendez made it up (``torch-1f2e3d4c5b6a`` -> ``torch``)."""
    made = _MADE_UP.fullmatch(job)
    if made is None:
        return job
    return made.group(1) or made.group(2)
