"""``arendez-run``: start N local ranks of a script (torchrun-style), with an embedded server.

``arendez-run --nproc 4 train.py --lr 0.1`` starts ``python -m arendez_server`` on a free loopback
port (unless ``--server`` names one), then four ``python train.py --lr 0.1`` processes with
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` and ``ARENDEZ_URL`` set, so the
script's ``await arendez.init_process_group()`` joins through ``env://``. Every output line is
prefixed with ``[rank K]``. The first rank to fail (``arendez.blame``) decides the exit code and
the others are terminated; SIGINT/SIGTERM are forwarded to every rank. Each rank runs in its own
session, so its children are killed with it, and a watchdog (``arendez.watchdog``) stops every
session if the launcher itself is killed: nothing outlives the launcher.

Elastic (``--max-restarts K`` and/or ``--min-nproc M``): the ranks get ``ARENDEZ_MIN_WORLD_SIZE``
(``WORLD_SIZE`` is the max) and join elastic rounds (``arendez.elastic``); a rank that fails is
started again in its slot (same ``RANK``/``LOCAL_RANK``, ``ARENDEZ_RESTART_COUNT`` counts its
restarts), at most K times over the job, while the others re-form without it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import sys
import tempfile
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from . import blame, children, errorfile, jobnames, validate

T = TypeVar("T")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="arendez-run",
        description="Run N local ranks of a script with the arendez env:// convention.",
        epilog="Exit status: without --max-restarts/--min-nproc, 0 when every rank exits 0, else the "
        "status of the first rank to fail (128+N for signal N; the others are terminated). Elastic: "
        "0 when the script finished (exit 0) on at least --min-nproc ranks and no rank failed after "
        "the first one finished (failed ranks that were restarted, ranks that the others went on "
        "without, and replacements that fail after the job finished without them, do not count); "
        "else the status of the first failure that was not recovered "
        "(restarts used up and fewer than --min-nproc ranks left, or a failure after a rank "
        "finished), or 1. 128+N when the launcher got signal N; 2 for a usage error.",
    )
    p.add_argument(
        "--nproc",
        "--nproc-per-node",
        type=validate.argtype(validate.at_least, 1, "--nproc"),
        default=1,
        help="ranks to start (default 1)",
    )
    p.add_argument(
        "--max-restarts",
        type=validate.argtype(validate.at_least, 0, "--max-restarts"),
        default=0,
        help="elastic: restart a failed rank in its slot, at most this many times in all (default 0)",
    )
    p.add_argument(
        "--min-nproc",
        type=validate.argtype(validate.at_least, 1, "--min-nproc"),
        default=None,
        help="elastic: the job goes on with as few as this many ranks (default --nproc; like "
        "torchrun's --nnodes=MIN:MAX); the ranks must re-form (arendez.reform) after a failure",
    )
    p.add_argument(
        "--finish-timeout",
        type=validate.argtype(validate.seconds, "--finish-timeout"),
        default=30.0,
        help="elastic: once a rank has finished, seconds the others get to finish before they are "
        "stopped (a replacement that arrived too late waits for a round that never forms; default 30)",
    )
    p.add_argument(
        "--server",
        help="arendez://[token@]host:port[/job] of a running arendez-server (default: start one here)",
    )
    p.add_argument("--job", help="job name on the server (default: a unique run-<pid>-<hex>)")
    p.add_argument(
        "--grace",
        type=validate.argtype(validate.seconds, "--grace", allow_zero=True),
        default=5.0,
        help="seconds between SIGTERM and SIGKILL (default 5)",
    )
    p.add_argument("-m", "--module", action="store_true", help="run the target as a module (python -m)")
    p.add_argument("script", help="the script (or module, with -m) every rank runs")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    return p


def job_url(server: str, job: str | None) -> str:
    """``server`` (a URL, or bare ``host:port``) with ``job`` as its path."""
    if "://" not in server:
        server = f"arendez://{server}"
    parts = urllib.parse.urlsplit(server)
    if parts.scheme not in ("arendez", "etcd") or not parts.netloc:  # etcd:// (issue 14)
        raise ValueError(f"--server must look like arendez://host:port[/job] or etcd://..., got {server!r}")
    path = parts.path.strip("/")
    if path and job and path != job:
        raise ValueError(f"--server names job {path!r} but --job says {job!r}")
    name = job or path or jobnames.for_launch(os.getpid())
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, "/" + name, parts.query, ""))


def rank_env(
    base: dict[str, str],
    url: str,
    rank: int,
    nproc: int,
    min_nproc: int | None = None,
    restart: int = 0,
    error_file: str | None = None,
) -> dict[str, str]:
    """The environment of local rank ``rank`` of ``nproc`` (elastic: of ``min_nproc``..``nproc``);
    the rank notes its failure in ``error_file`` (``arendez.errorfile``)."""
    env = dict(base)
    for name in ("MASTER_ADDR", "MASTER_PORT", "GROUP_RANK", "NODE_RANK", errorfile.ENV):
        env.pop(name, None)
    if error_file is not None:
        env[errorfile.ENV] = error_file
    env.update(
        ARENDEZ_URL=url,
        RANK=str(rank),
        WORLD_SIZE=str(nproc),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(nproc),
    )
    env.pop("ARENDEZ_MIN_WORLD_SIZE", None)
    if min_nproc is not None:
        env.update(ARENDEZ_MIN_WORLD_SIZE=str(min_nproc), ARENDEZ_RESTART_COUNT=str(restart))
    env.setdefault("PYTHONUNBUFFERED", "1")  # so interleaved rank output appears as it happens
    return env


def exit_code(returncode: int) -> int:
    """A shell-style exit status: ``128 + signum`` for a process killed by a signal."""
    return 128 - returncode if returncode < 0 else returncode


def _say(message: str) -> None:
    print(f"arendez-run: {message}", file=sys.stderr, flush=True)


async def _server_url(server: children.Child, timeout: float = 30.0) -> str:
    """The URL the embedded server prints once it listens."""
    try:
        line = await asyncio.wait_for(server.stdout.readline(), timeout)
    except TimeoutError:
        line = b""
    text = line.decode(errors="replace").strip()
    if "listening on " not in text:
        server.signal(signal.SIGKILL)
        await server.proc.wait()
        err = await server.stderr.read()
        raise RuntimeError(f"the embedded server did not start: {text!r} {err.decode(errors='replace')}")
    server.pump(b"[server] ")
    return text.rsplit(" ", 1)[-1]


async def _explain_unreachable(url: str) -> None:
    """After a failed run against ``--server``: say so if that server cannot be reached."""
    why = await blame.server_unreachable(url)
    if why is not None:
        _say(f"the server at {url} cannot be reached ({why}): the ranks could not join")


@dataclass
class _Elastic:
    """What the elastic supervisor needs to start a rank again in its slot."""

    argv: list[str]
    base: dict[str, str]
    url: str
    nproc: int
    min_nproc: int
    max_restarts: int
    finish_timeout: float
    grace: float
    watchdog: _Watchdog
    kill_now: asyncio.Event
    restarts: int = 0

    async def start(self, slot: int, restart: int) -> children.Child:
        env = rank_env(self.base, self.url, slot, self.nproc, self.min_nproc, restart)
        child = await children.spawn(f"rank {slot}", self.argv, env)
        self.watchdog.watch(child)
        child.pump(f"[rank {slot}] ".encode())
        return child


async def _supervise(ranks: list[children.Child], el: _Elastic) -> int:
    """Elastic runs: restart failed ranks in their slots (``el.max_restarts`` in all) until the
    script has finished; the exit status as ``arendez-run --help`` describes it."""
    loop = asyncio.get_running_loop()
    finished: set[int] = set()
    lost: dict[int, int] = {}  # slot -> exit status, for failures nobody replaced
    unrecovered: int | None = None  # the status of the first failure that counts
    restarted = [0] * len(ranks)
    finish_by: float | None = None
    waits = {slot: asyncio.ensure_future(c.proc.wait()) for slot, c in enumerate(ranks)}
    try:
        while waits:
            timeout = None if finish_by is None else max(0.0, finish_by - loop.time())
            done, _ = await asyncio.wait(waits.values(), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if not done:  # the finish timeout: whoever still runs waits for a round that never forms
                late = sorted(waits)
                _say(f"rank(s) {late} still running {el.finish_timeout:g}s after one finished; stopping them")
                await children.stop([ranks[s] for s in late], signal.SIGTERM, el.grace, el.kill_now)
                break
            for slot in [s for s, w in waits.items() if w in done]:
                code = exit_code(waits.pop(slot).result())
                if code == 0:
                    finished.add(slot)
                    if finish_by is None:
                        finish_by = loop.time() + el.finish_timeout
                    continue
                if not finished and el.restarts < el.max_restarts:
                    el.restarts += 1
                    restarted[slot] += 1
                    _say(
                        f"rank {slot} failed with exit code {code}; restarting it "
                        f"(restart {el.restarts} of {el.max_restarts})"
                    )
                    old, ranks[slot] = ranks[slot], await el.start(slot, restarted[slot])
                    waits[slot] = asyncio.ensure_future(ranks[slot].proc.wait())
                    await children.drain([old], timeout=1.0)  # its output, then its pipes
                    continue
                lost[slot] = code
                why = "a rank had already finished" if finished else "no restarts left"
                if finished and restarted[slot]:  # (a replacement that most likely came too late)
                    why += "; a replacement: not counted"
                going_on = len(waits) + len(finished) >= el.min_nproc  # (else: said below)
                _say(
                    f"rank {slot} failed with exit code {code} ({why})"
                    + ("; the job goes on without it" if going_on else "")
                )
                if finished and unrecovered is None and not restarted[slot]:
                    unrecovered = code
            if len(waits) + len(finished) < el.min_nproc:
                first = next(iter(lost.values()), 1)
                _say(
                    f"only {len(waits) + len(finished)} rank(s) left, fewer than --min-nproc "
                    f"{el.min_nproc}; terminating the others"
                )
                await children.stop([ranks[s] for s in waits], signal.SIGTERM, el.grace, el.kill_now)
                return first
        if unrecovered is not None:
            return unrecovered
        if len(finished) >= el.min_nproc:
            return 0
        return next(iter(lost.values()), 1)
    finally:
        for w in waits.values():
            w.cancel()


async def _unless(stop: asyncio.Event, work: asyncio.Future[T]) -> asyncio.Future[T] | None:
    """Wait for ``work`` or ``stop``, whichever comes first; ``work`` is cancelled on ``stop``."""
    halt = asyncio.ensure_future(stop.wait())
    either: list[asyncio.Future[Any]] = [work, halt]
    await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
    halt.cancel()
    if work.done():
        return work
    work.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await work
    return None


class _Watchdog:
    """The ``arendez.watchdog`` process that stops our children if we are killed."""

    def __init__(self, proc: asyncio.subprocess.Process | None) -> None:
        self._proc = proc

    @classmethod
    async def start(cls, grace: float) -> _Watchdog:
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "arendez.watchdog",
                str(grace),
                stdin=asyncio.subprocess.PIPE,
                start_new_session=True,  # a killpg of our group must not take it too
            )
        except OSError as exc:
            _say(f"no watchdog ({exc}): if this launcher is killed, its ranks may outlive it")
            return cls(None)
        return cls(proc)

    def _tell(self, line: str) -> None:
        if self._proc is not None and self._proc.stdin is not None:
            with contextlib.suppress(OSError, RuntimeError):
                self._proc.stdin.write(f"{line}\n".encode())

    def watch(self, child: children.Child) -> None:
        self._tell(str(child.proc.pid))  # start_new_session: its process group id

    def scratch(self, path: str) -> None:
        """``path`` goes too if we are killed."""
        self._tell(f"dir {path}")

    async def done(self) -> None:
        """Everything was stopped by us: let the watchdog go."""
        if self._proc is None:
            return
        self._tell("done")
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        try:
            await asyncio.wait_for(self._proc.wait(), 5.0)
        except TimeoutError:
            self._proc.kill()
            await self._proc.wait()


async def _run(args: argparse.Namespace) -> int:
    loop = asyncio.get_running_loop()
    stop, kill_now = asyncio.Event(), asyncio.Event()
    received: list[int] = []

    def on_signal(sig: int) -> None:
        received.append(sig)
        if stop.is_set():
            kill_now.set()  # a second signal: stop waiting for a graceful exit
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    server: children.Child | None = None
    ranks: list[children.Child] = []
    watchdog = await _Watchdog.start(args.grace)
    notedir = tempfile.mkdtemp(prefix="arendez-run-")
    watchdog.scratch(notedir)
    notes = [os.path.join(notedir, f"rank-{rank}.json") for rank in range(args.nproc)]
    try:
        base = dict(os.environ)
        if args.server:
            url = job_url(args.server, args.job)
        else:
            argv = [sys.executable, "-m", "arendez_server", "--host", "127.0.0.1", "--port", "0"]
            server = await children.spawn("server", [*argv, "--log-level", "WARNING"], base)
            watchdog.watch(server)
            started = await _unless(stop, asyncio.ensure_future(_server_url(server)))
            if started is None:
                return 128 + received[0]
            url = job_url(started.result(), args.job)
        target = ["-m", args.script] if args.module else [args.script]
        elastic = _elastic_of(args, [sys.executable, *target, *args.args], base, url, watchdog, kill_now)
        for rank in range(args.nproc):
            if stop.is_set():
                break
            if elastic is not None:
                ranks.append(await elastic.start(rank, 0))
                continue
            env = rank_env(base, url, rank, args.nproc, error_file=notes[rank])
            child = await children.spawn(f"rank {rank}", [sys.executable, *target, *args.args], env)
            watchdog.watch(child)
            child.pump(f"[rank {rank}] ".encode())
            ranks.append(child)
        if elastic is not None:
            supervised = await _unless(stop, asyncio.ensure_future(_supervise(ranks, elastic)))
            if supervised is not None:
                if supervised.result() != 0 and args.server:
                    await _explain_unreachable(url)
                return supervised.result()
        outcome = await _unless(stop, asyncio.ensure_future(blame.first_failure(ranks, notes)))
        if stop.is_set():
            signum = received[0]
            _say(f"got {signal.Signals(signum).name}; forwarding it to {len(ranks)} rank(s)")
            await children.stop(ranks, signum, args.grace, kill_now)
            return 128 + signum
        assert outcome is not None
        failure = outcome.result()
        if failure is None:
            return 0
        code = exit_code(failure.returncode)
        why = f" ({failure.why})" if failure.why else ""
        first = f"rank {failure.rank} failed with exit code {code}, the first to fail{why}"
        if failure.reported is not None:
            first = (
                f"rank {failure.rank} stopped answering (it has not ended: stopped or hung), the first to "
                f"fail, as rank {failure.reported} reported ({failure.why}; it exited with code {code})"
            )
        _say(f"{first}; terminating the other ranks")
        await children.stop(ranks, signal.SIGTERM, args.grace, kill_now)
        if args.server:
            await _explain_unreachable(url)
        return code
    except (RuntimeError, ValueError, OSError) as exc:
        _say(str(exc))
        return 1
    finally:
        # Every path ends here: no rank, child of a rank or server outlives the launcher.
        await children.stop(ranks, signal.SIGTERM, args.grace, kill_now)
        await children.drain(ranks)
        if server is not None:
            await children.stop([server], signal.SIGTERM, args.grace, kill_now)
            await children.drain([server])
        await watchdog.done()
        shutil.rmtree(notedir, ignore_errors=True)
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def _elastic_of(
    args: argparse.Namespace,
    argv: list[str],
    base: dict[str, str],
    url: str,
    watchdog: _Watchdog,
    kill_now: asyncio.Event,
) -> _Elastic | None:
    if not is_elastic(args):
        return None
    low = args.min_nproc if args.min_nproc is not None else args.nproc
    return _Elastic(
        argv,
        base,
        url,
        args.nproc,
        low,
        args.max_restarts,
        args.finish_timeout,
        args.grace,
        watchdog,
        kill_now,
    )


def is_elastic(args: argparse.Namespace) -> bool:
    return bool(args.max_restarts) or args.min_nproc is not None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``arendez-run``; returns the process exit status."""
    args = _parser().parse_args(argv)
    if not args.module:
        try:
            validate.readable_file(args.script, "script")
        except (TypeError, ValueError) as exc:
            _parser().error(str(exc))
    if args.server:
        try:
            job_url(args.server, args.job)
        except ValueError as exc:
            _parser().error(str(exc))
    if args.min_nproc is not None and args.min_nproc > args.nproc:
        _parser().error(f"--min-nproc must be at most --nproc ({args.nproc}), got {args.min_nproc}")
    if is_elastic(args) and args.server and args.server.startswith("etcd://"):
        _parser().error("--max-restarts/--min-nproc need an arendez server: etcd:// has no elastic rounds")
    return asyncio.run(_run(args))


if __name__ == "__main__":
    sys.exit(main())
