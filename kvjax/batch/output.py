"""The batch output file: one JSON line per input id, appended so a kill loses nothing.

Each line goes out in one `os.write` on an O_APPEND descriptor, then fsync: after a SIGKILL
the file holds whole lines plus at most one torn final line (no newline), which `open_log`
cuts off before the job resumes. Ids on whole lines are done and are never run again.
"""

from __future__ import annotations

import json
import os


def _cut_torn_tail(path: str) -> None:
    """Truncates `path` after its last newline: a line without one was torn by a kill."""
    with open(path, "rb+") as f:
        data = f.read()
        end = data.rfind(b"\n") + 1
        if end != len(data):
            f.truncate(end)
            f.flush()
            os.fsync(f.fileno())


def done_ids(path: str) -> set[str]:
    """Ids with a whole line in the output at `path` (empty if there is no file)."""
    if not os.path.exists(path):
        return set()
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")[:-1]  # The last piece is empty or torn.
    return {json.loads(line)["id"] for line in lines if line.strip()}


class OutputLog:
    """An append-only JSONL output; opening it cuts a torn final line and reads what is done.

    Attributes:
      done: ids that already have a whole line (they are skipped on a re-run).
    """

    def __init__(self, path: str):
        if os.path.exists(path):
            _cut_torn_tail(path)
        self.done = done_ids(path)
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, record: dict) -> None:
        """Appends one record as a line, durably, and marks its id done."""
        data = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        # One write per line: a kill tears at most this line, never interleaves two.
        written = os.write(self._fd, data)
        if written != len(data):
            raise OSError(f"short write to the batch output ({written} of {len(data)} bytes)")
        os.fsync(self._fd)
        self.done.add(record["id"])

    def close(self) -> None:
        os.close(self._fd)

    def __enter__(self) -> OutputLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
