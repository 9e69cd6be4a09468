"""Merge the flight recorder dumps of one job and say where it is stuck.

For every group, each rank's *frontier* is its oldest collective after the last one it
completed that has not completed (running, timed out, failed). Ranks are grouped by the
sequence number they are stuck at; the ranks they wait for are the members that never reached
that collective (their dump shows an earlier last completed seq, or they left no dump and the
stuck ranks name them), else the peers whose messages have not arrived. One line each::

    group 0 seq 17 all_reduce (float32 x 2): ranks 0,1,3 waiting on rank 2 (rank 2 last completed seq 16)
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

Dump = dict[str, Any]


#: Runs of consecutive ranks a list names before it ends in "... (N ranks)".
MAX_RUNS = 24
#: Per-rank notes a line gives before it ends in "and N more".
MAX_NOTES = 16


def ranks_text(ranks: Iterable[int]) -> str:
    """``rank 2`` or ``ranks 0,1,3`` or ``ranks 0-2049,2051-4999 (4999 ranks)``: runs of
    consecutive ranks as ranges, at most ``MAX_RUNS`` of them."""
    rs = sorted(set(ranks))
    if len(rs) == 1:
        return f"rank {rs[0]}"
    runs: list[list[int]] = []
    for r in rs:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    shown = [str(a) if a == b else f"{a},{b}" if b == a + 1 else f"{a}-{b}" for a, b in runs[:MAX_RUNS]]
    text = "ranks " + ",".join(shown)
    if len(runs) > MAX_RUNS:
        text += ",..."
    if len(runs) > MAX_RUNS or (len(rs) >= 10 and len(rs) > len(runs)):  # (ranges hide the count)
        text += f" ({len(rs)} ranks)"
    return text


def load(paths: Sequence[str | os.PathLike[str]]) -> tuple[list[Dump], list[str]]:
    """The dumps in ``paths`` (files, or directories holding ``arendez-flightrec-*.json``) and
    one complaint per file that could not be read."""
    files: list[Path] = []
    for p in map(Path, paths):
        files.extend(sorted(p.glob("arendez-flightrec-*.json")) if p.is_dir() else [p])
    dumps: list[Dump] = []
    problems: list[str] = []
    for f in files:
        try:
            data = json.loads(f.read_text())
            if not isinstance(data, dict) or "entries" not in data or "rank" not in data:
                raise ValueError("not a flight recorder dump (no rank / entries)")
        except (OSError, ValueError) as exc:
            problems.append(f"skipped {f}: {exc}")
            continue
        data["_file"] = str(f)
        dumps.append(data)
    return dumps, problems


def _newest_per_rank(dumps: list[Dump]) -> dict[int, Dump]:
    out: dict[int, Dump] = {}
    for d in dumps:
        r = int(d["rank"])
        if r not in out or d.get("time_ns", 0) >= out[r].get("time_ns", 0):
            out[r] = d
    return out


def _what(e: dict[str, Any]) -> str:
    if e.get("dtype") and e.get("count") is not None:
        return f"{e['op']} ({e['dtype']} x {e['count']})"
    return str(e["op"])


def _frontier(d: Dump, gid: str) -> dict[str, Any] | None:
    """The oldest collective of group ``gid`` after the last completed one that did not
    complete on this rank."""
    last = int(d["groups"].get(gid, {}).get("last_completed_seq", -1))
    mine = [e for e in d["entries"] if str(e["group"]) == gid and e["seq"] > last]
    unfinished = [e for e in mine if e["state"] != "completed"]
    return min(unfinished, key=lambda e: e["seq"]) if unfinished else None


def _reached(d: Dump, gid: str, seq: int) -> bool:
    g = d["groups"].get(gid, {})
    if int(g.get("last_completed_seq", -1)) >= seq:
        return True
    if g.get("next_seq") is not None and int(g["next_seq"]) > seq:
        return True
    return any(str(e["group"]) == gid and e["seq"] == seq for e in d["entries"])


def analyze(dumps: list[Dump]) -> list[str]:
    """The report, line by line."""
    if not dumps:
        return ["no flight recorder dumps"]
    newest = max(dumps, key=lambda d: d.get("time_ns", 0))
    job = str(newest.get("job"))
    others = [d for d in dumps if str(d.get("job")) != job]
    by_rank = _newest_per_rank([d for d in dumps if str(d.get("job")) == job])
    size = max(int(d.get("world_size", 0)) for d in by_rank.values())
    lines = [f"job {job}: dumps from {ranks_text(by_rank)} of world size {size}"]
    if others:  # (files of an earlier run left in the same directory under the same name)
        names = ", ".join(sorted({str(d.get("job")) for d in others}))
        lines.append(f"left out {len(others)} dump(s) of other job(s), older: {names}")
    absent = [r for r in range(size) if r not in by_rank]
    if absent:
        lines.append(f"no dump from {ranks_text(absent)}")
    dead: dict[int, str] = {}
    for d in by_rank.values():
        for r, why in d.get("dead_ranks", {}).items():
            dead.setdefault(int(r), why)
    by_reason: dict[str, list[int]] = {}
    for r, why in sorted(dead.items()):
        by_reason.setdefault(why, []).append(r)
    for why, rs in sorted(by_reason.items(), key=lambda item: item[1][0]):
        lines.append(f"{ranks_text(rs)} {'is' if len(rs) == 1 else 'are'} gone: {why}")
    gids = sorted({g for d in by_rank.values() for g in d.get("groups", {})}, key=int)
    for gid in gids:
        lines.extend(_group(gid, by_rank, dead))
    return lines


def _group(gid: str, by_rank: dict[int, Dump], dead: dict[int, str]) -> list[str]:
    members: list[int] = next(d["groups"][gid]["ranks"] for d in by_rank.values() if gid in d["groups"])
    have = {r: by_rank[r] for r in members if r in by_rank and gid in by_rank[r]["groups"]}
    stuck = {r: f for r, d in have.items() if (f := _frontier(d, gid)) is not None}
    last = {r: int(d["groups"][gid].get("last_completed_seq", -1)) for r, d in have.items()}
    if not stuck:
        seqs = sorted(set(last.values()))
        if len(seqs) == 1:
            return [f"group {gid}: nothing pending; every dumped rank completed seq {seqs[0]}"]
        parts = [f"{ranks_text(r for r in last if last[r] == s)} completed seq {s}" for s in seqs]
        return [f"group {gid}: nothing pending; " + ", ".join(parts)]
    lines = []
    for seq in sorted({f["seq"] for f in stuck.values()}):
        at = sorted(r for r, f in stuck.items() if f["seq"] == seq)
        entries = [stuck[r] for r in at]
        whats = {r: _what(stuck[r]) for r in at}
        named: set[int] = set()
        for e in entries:
            named.update(e.get("peers_pending", []), e.get("missing", []), e.get("unresponsive", []))
        behind = {r for r, d in have.items() if r not in at and not _reached(d, gid, seq)}
        # (a rank that left in good order is no culprit unless a stuck rank names it)
        failed = {r for r, why in dead.items() if not why.startswith("it left")}
        silent = {r for r in members if r not in have and (r in named or r in failed)}
        culprits = behind | silent
        if culprits:
            notes = []
            for r in sorted(culprits):
                if r in dead:
                    notes.append(f"rank {r} gone: {dead[r]}")
                elif r in have:
                    f = stuck.get(r)
                    more = f", stuck at seq {f['seq']} {_what(f)}" if f is not None else ""
                    notes.append(f"rank {r} last completed seq {last[r]}{more}")
                else:
                    notes.append(f"no dump from rank {r}")
            if len(notes) > MAX_NOTES:
                notes[MAX_NOTES:] = [f"and {len(notes) - MAX_NOTES} more"]
            waits = f"waiting on {ranks_text(culprits)} ({'; '.join(notes)})"
        elif named:
            waits = f"waiting on {ranks_text(named)} (in this collective too: slow peer or network)"
        else:
            waits = "waiting on no rank this dump can name"
        head = whats[at[0]] if len(set(whats.values())) == 1 else "MISMATCHED collectives"
        lines.append(f"group {gid} seq {seq} {head}: {ranks_text(at)} {waits}")
        if len(set(whats.values())) > 1:
            for r in at:
                lines.append(f"  rank {r} runs {whats[r]}")
        states: dict[str, list[int]] = {}
        for r in at:
            states.setdefault(stuck[r]["state"], []).append(r)
        for state, rs in sorted(states.items()):
            e = stuck[rs[0]]
            waited = e.get("duration_ms") if e.get("duration_ms") is not None else e.get("waited_ms")
            err = f": {e['error']}" if e.get("error") else ""
            lines.append(f"  {state} on {ranks_text(rs)} after {waited} ms{err}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m arendez.flightrec",
        description="Merge arendez flight recorder dumps and say which collective each rank is stuck on.",
    )
    parser.add_argument("paths", nargs="+", help="dump files, or directories holding them")
    args = parser.parse_args(argv)
    dumps, problems = load(args.paths)
    for problem in problems:
        print(problem)
    for line in analyze(dumps):
        print(line)
    return 0 if dumps else 1
