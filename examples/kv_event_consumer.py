"""A router-side KV event consumer: rebuild from a snapshot, then follow the event stream.

The consumer keeps chunk -> {(node, epoch, tier)} and persists the id of the last applied
event, so after a restart it resumes exactly there (no event lost, none applied twice). With no
saved id it rebuilds from ``snapshot()``. (Not handled here: a stream that lost the saved id
because Redis restarted empty; a router then deletes its state file and starts over.)

Run: ``python examples/kv_event_consumer.py redis://127.0.0.1:6379/0 state.id`` (``--help`` for
the options); it prints one line per event until Ctrl-C, or until ``--max-events`` were applied.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvfabric.cluster import GlobalIndex, KVEvent

Owner = tuple[str, int, str]


class RouterView:
    """Which nodes hold which chunks, as seen through the event stream."""

    def __init__(self, index: GlobalIndex, state_file: Path) -> None:
        self.index, self.state_file = index, state_file
        self.chunks: dict[tuple[str, bytes], set[Owner]] = {}
        self.last_id = "0-0"
        self.applied = 0

    def start(self) -> None:
        """Resume from the saved id, or rebuild from a snapshot when there is none."""
        if self.state_file.exists():
            self.last_id = self.state_file.read_text().strip()
            # A real router also persists its view; this one replays the stream from its start.
            for event in self._read("0-0", upto=self.last_id):
                self._apply(event)
        else:
            snap = self.index.snapshot()
            for event in snap.events:
                self._apply(event)
            self._save(snap.stream_id)

    def poll(self, block_ms: int = 1000, count: int = 1000) -> list[KVEvent]:
        events = self.index.events(self.last_id, block_ms=block_ms, count=count)
        for event in events:
            self._apply(event)
            self.applied += 1
        if events:
            self._save(events[-1].stream_id)
        return events

    def _read(self, after: str, upto: str) -> list[KVEvent]:
        out: list[KVEvent] = []
        while True:
            page = self.index.events(after, count=1000)
            for event in page:
                if _id(event.stream_id) > _id(upto):
                    return out
                out.append(event)
            if not page:
                return out
            after = page[-1].stream_id

    def _apply(self, event: KVEvent) -> None:
        for key in event.keys:
            owners = self.chunks.setdefault((event.seed_hex, key), set())
            owner = (event.node_id, event.epoch, event.tier)
            if event.kind == "stored":
                owners.add(owner)
            else:
                owners.discard(owner)
                if not owners:
                    del self.chunks[(event.seed_hex, key)]

    def _save(self, stream_id: str) -> None:
        self.last_id = stream_id
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(stream_id)
        tmp.replace(self.state_file)  # atomic: a crash leaves the old or the new id


def _id(stream_id: str) -> tuple[int, int]:
    ms, _, seq = stream_id.partition("-")
    return int(ms), int(seq or 0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Follow a kvfabric cluster's KV event stream (Redis global index): rebuild "
        "from a snapshot on first start, resume from the saved event id after."
    )
    parser.add_argument("url", help="the global index's Redis URL, e.g. redis://127.0.0.1:6379/0")
    parser.add_argument(
        "state_file", type=Path, help="where the id of the last applied event is kept (created)"
    )
    parser.add_argument(
        "--max-events",
        type=int,
        default=None,
        metavar="N",
        help="exit once N events were applied (default: follow until Ctrl-C)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from kvfabric.cluster.redis_index import RedisGlobalIndex  # redis-py: only to run

    applied = 0
    with RedisGlobalIndex(args.url) as index:
        view = RouterView(index, args.state_file)
        view.start()
        print(
            f"following {args.url}: {len(view.chunks)} chunks known, from event {view.last_id}",
            flush=True,
        )
        try:
            while args.max_events is None or applied < args.max_events:
                for event in view.poll():
                    applied += 1
                    print(
                        event.stream_id,
                        event.kind,
                        event.node_id,
                        event.tier,
                        len(event.keys),
                        flush=True,
                    )
        except KeyboardInterrupt:  # Ctrl-C is the normal way out: no traceback
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
