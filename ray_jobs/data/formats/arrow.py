"""Arrow IPC streams (a ``datasets`` ``save_to_disk`` folder's files, named by its state.json): a stream cannot be
entered mid-way, so the planner reads it in record batches; a folder's listing does not pick ``.arrow`` files on
their own."""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import IO, Any

from ray_jobs.data.formats.base import Position, SourceBatch, SourceFile, SourceUnreadable, Unit, readable, row_batches
from ray_jobs.storage import fs_and_path


class ArrowStream:
    name: str = "arrow"
    suffixes: tuple[str, ...] = (".arrow",)
    unit: Unit = "row"
    listed: bool = False
    splittable: bool = False

    def batches(
        self, url: str, f: IO[bytes], start: Position, batch_bytes: int, max_chars: int | None
    ) -> Iterator[SourceBatch]:
        import pyarrow as pa

        with readable(url, "Arrow"):
            yield from row_batches(url, pa.ipc.open_stream(f), start)

    def read_range(
        self, url: str, f: IO[bytes], start: int, stop: int | None, max_chars: int | None
    ) -> tuple[list[tuple[int, Any]], int]:
        raise TypeError(f"{url}: an Arrow stream cannot be entered mid-way; the planner reads it in batches")

    def bounds(self, url: str, start: int, size: int, piece_bytes: int) -> list[int]:
        raise TypeError(f"{url}: an Arrow stream is not cut into ranges")

    def rows(self, src: SourceFile) -> list[dict[str, Any]]:
        import pyarrow as pa

        with readable(src.url, "Arrow"):
            return pa.ipc.open_stream(io.BytesIO(src.data)).read_all().to_pylist()

    def columns(self, url: str) -> list[str] | None:
        import pyarrow as pa

        fs, path = fs_and_path(url)
        try:
            with fs.open(path, "rb") as f, readable(url, "Arrow"):
                return list(pa.ipc.open_stream(f).schema.names)
        except OSError as e:
            raise SourceUnreadable(f"{url}: cannot read: {e}") from e

    def row_count(self, url: str) -> int | None:
        return None  # a stream says its length only once read to its end


READER = ArrowStream()
