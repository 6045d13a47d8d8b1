"""``keel quarantine``: operator commands on the quarantine (or review) stream.

Run: keel quarantine [--redis-url URL] [--stream quarantine|review] [--operator NAME] [--json] CMD
     (or python -m services.validator.quarantine_cli ...)
  list [--count N] [--status new|claimed|done]   newest entries with their status and owner
  show ID                                        one entry in full (stream id or record_id)
  claim [--count N]                              take the next N entries for yourself
  replay ID                                      send a claimed entry through the gateway, ack it
  ack ID                                         close a claimed entry without replaying it
  purge --older-than DURATION                    delete entries older than e.g. 7d, 12h, 1h30m

Exit status: 0 ok, 1 replay failed (entry stays claimed by you), 2 usage, 3 refused (claimed by
someone else, already done, not claimed), 4 not found, 5 Redis unreachable.
The Redis URL defaults to $KEEL_REDIS_URL, else the QuarantineConfig default; the operator name
to user@host.
"""
from __future__ import annotations

import argparse
import getpass
import json
import os
import socket
import sys
import time
from collections.abc import Callable, Sequence

import redis

from services.validator.operators import Entry, QuarantineOps
from services.validator.quarantine import QuarantineConfig
from shared.durations import parse_duration
from shared.errors import NotFound, PreconditionFailed


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="keel quarantine", description=__doc__.splitlines()[0])
    p.add_argument("--redis-url", default=None)
    p.add_argument("--stream", choices=("quarantine", "review"), default="quarantine")
    p.add_argument("--operator", default=None, help="consumer name (default user@host)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    sub = p.add_subparsers(dest="cmd", required=True)
    ls = sub.add_parser("list")
    ls.add_argument("--count", type=int, default=20)
    ls.add_argument("--status", choices=("new", "claimed", "done"))
    sub.add_parser("show").add_argument("id")
    sub.add_parser("claim").add_argument("--count", type=int, default=1)
    sub.add_parser("replay").add_argument("id")
    sub.add_parser("ack").add_argument("id")
    sub.add_parser("purge").add_argument("--older-than", required=True, type=parse_duration)
    return p


def _line(e: Entry) -> str:
    r = e.record
    when = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(r.ts_ms / 1000))
    status = f"{e.status}({e.owner})" if e.owner else e.status
    return (f"{e.stream_id:<16} {status:<24} {when}Z {r.reason:<20} {r.rule:<32} "
            f"{r.source}/{r.domain} {r.record_id}")


def _as_dict(e: Entry) -> dict:
    return {"stream_id": e.stream_id, "status": e.status, "owner": e.owner,
            **json.loads(e.record.to_json())}


def _emit(entries: list[Entry], as_json: bool, out) -> None:
    if as_json:
        print(json.dumps([_as_dict(e) for e in entries], ensure_ascii=False), file=out)
    else:
        for e in entries:
            print(_line(e), file=out)


def _run(args: argparse.Namespace, ops: QuarantineOps, replay_fn, out) -> int:
    if args.cmd == "list":
        _emit(ops.list(args.count, args.status), args.json, out)
    elif args.cmd == "show":
        print(json.dumps(_as_dict(ops.show(args.id)), ensure_ascii=False,
                         indent=None if args.json else 2), file=out)
    elif args.cmd == "claim":
        _emit(ops.claim(args.count), args.json, out)
    elif args.cmd == "ack":
        entry = ops.hold(args.id)
        ops.done(entry)
        print(f"acked {entry.stream_id}", file=out)
    elif args.cmd == "purge":
        print(f"purged {ops.purge(args.older_than)} entries", file=out)
    else:
        if replay_fn is None:
            print("replay is not available: no replay function wired in", file=sys.stderr)
            return 2
        entry = ops.hold(args.id)
        try:
            result = replay_fn(dict(entry.record.payload))
        except Exception as exc:  # noqa: BLE001 - any failure of the replay leaves it claimed
            print(f"replay of {args.id} failed, still claimed by you: {exc!r}", file=sys.stderr)
            return 1
        ops.done(entry)
        print(json.dumps({"replayed": args.id, "result": result}, ensure_ascii=False,
                         default=str), file=out)
    return 0


def main(argv: Sequence[str], replay_fn: Callable[[dict], dict] | None = None, *,
         cfg: QuarantineConfig | None = None, out=None) -> int:
    out = out or sys.stdout
    try:
        args = _parser().parse_args(list(argv))
    except SystemExit as exc:   # argparse exits on --help and on usage errors
        return int(exc.code or 0) if exc.code in (0, None) else 2
    cfg = cfg or QuarantineConfig()
    url = args.redis_url or os.environ.get("KEEL_REDIS_URL") or cfg.redis_url
    client = redis.Redis.from_url(url, decode_responses=True, socket_timeout=5,
                                  socket_connect_timeout=2)
    ops = QuarantineOps(client, stream=cfg.review_stream if args.stream == "review" else cfg.stream,
                        group=cfg.group, key_prefix=cfg.key_prefix, claim_idle_s=cfg.claim_idle_s,
                        operator=args.operator or f"{getpass.getuser()}@{socket.gethostname()}")
    try:
        return _run(args, ops, replay_fn, out)
    except NotFound as exc:
        print(exc.message, file=sys.stderr)
        return 4
    except PreconditionFailed as exc:
        print(exc.message, file=sys.stderr)
        return 3
    except redis.ConnectionError as exc:
        print(f"Redis unreachable at {url}: {exc}", file=sys.stderr)
        return 5
    finally:
        client.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
