"""Parquet: row ranges a worker reads itself, planned from the file's footer (small row groups together, big ones
cut), decoding only the row groups a range lies in."""

from __future__ import annotations

import io
from collections.abc import Generator, Iterator
from contextlib import contextmanager
from typing import IO, Any

from ray_jobs.data.formats.base import Position, SourceBatch, SourceFile, SourceUnreadable, StagingError, Unit
from ray_jobs.storage import fs_and_path


@contextmanager
def readable(url: str) -> Generator[None]:
    """pyarrow's errors for a damaged file as one StagingError naming it (pyarrow raises several types)."""
    import pyarrow as pa

    try:
        yield
    except (pa.ArrowException, ValueError) as e:
        raise StagingError(f"{url}: not a readable Parquet file: {e}") from e


class Parquet:
    name: str = "parquet"
    suffixes: tuple[str, ...] = (".parquet",)
    unit: Unit = "row"
    listed: bool = True
    splittable: bool = True

    def batches(self, url: str, f: IO[bytes], start: Position, batch_bytes: int,
                max_chars: int | None) -> Iterator[SourceBatch]:  # fmt: skip
        import pyarrow.parquet as pq

        with readable(url):
            yield from row_batches(url, pq.ParquetFile(f).iter_batches(batch_size=8192), start)

    def read_range(self, url: str, f: IO[bytes], start: int, stop: int | None,
                   max_chars: int | None) -> tuple[list[tuple[int, Any]], int]:  # fmt: skip
        """Rows [start, stop), decoding only the row groups they lie in."""
        import pyarrow.parquet as pq

        with readable(url):
            pf = pq.ParquetFile(f)
            total = pf.metadata.num_rows
            stop = total if stop is None else min(stop, total)
            groups, first, row = [], None, 0
            for g in range(pf.metadata.num_row_groups):
                n = pf.metadata.row_group(g).num_rows
                if row + n > start and row < stop:
                    groups.append(g)
                    first = row if first is None else first
                row += n
            rows: list[dict] = []
            row = first or 0
            for batch in pf.iter_batches(batch_size=8192, row_groups=groups) if groups else ():
                lo, hi = max(start - row, 0), min(stop - row, batch.num_rows)
                if lo < hi:
                    rows.extend(batch.slice(lo, hi - lo).to_pylist())
                row += batch.num_rows
        return list(enumerate(rows, start=1)), max(stop, start)

    def bounds(self, url: str, start: int, size: int, piece_bytes: int) -> list[int]:
        """Row numbers after ``start`` where pieces begin, about ``piece_bytes`` (uncompressed) each, from the footer
        alone."""
        md = _footer(url)
        cuts, row, held = [], 0, 0
        for g in range(md.num_row_groups):
            rg = md.row_group(g)
            per_row = rg.total_byte_size / max(rg.num_rows, 1)
            r = 0
            while r < rg.num_rows:
                take = min(rg.num_rows - r, max(1, int((piece_bytes - held) / per_row)) if per_row else rg.num_rows)
                r += take
                held += take * per_row
                if held >= piece_bytes:
                    cuts.append(row + r)
                    held = 0
            row += rg.num_rows
        return [c for c in cuts if start < c < row]

    def rows(self, src: SourceFile) -> list[dict[str, Any]]:
        import pyarrow.parquet as pq

        with readable(src.url):
            return pq.read_table(io.BytesIO(src.data)).to_pylist()

    def columns(self, url: str) -> list[str] | None:
        import pyarrow.parquet as pq

        fs, path = fs_and_path(url)
        try:
            with fs.open(path, "rb") as f, readable(url):
                return list(pq.ParquetFile(f).schema_arrow.names)
        except OSError as e:
            raise SourceUnreadable(f"{url}: cannot read: {e}") from e

    def row_count(self, url: str) -> int | None:
        try:
            return _footer(url).num_rows
        except Exception:  # progress only: the read itself reports a bad file
            return None


def _footer(url: str) -> Any:
    import pyarrow.parquet as pq

    fs, path = fs_and_path(url)
    try:
        with fs.open(path, "rb") as f, readable(url):
            return pq.ParquetFile(f).metadata
    except OSError as e:
        raise SourceUnreadable(f"{url}: cannot read: {e}") from e


def row_batches(url: str, batches: Any, start: Position) -> Iterator[SourceBatch]:
    """Rows of pyarrow record ``batches`` from row ``start.offset`` on, numbered from 1 (Parquet and Arrow alike)."""
    row = 0
    for batch in batches:
        rows = batch.to_pylist()
        skip = max(0, min(len(rows), start.offset - row))
        row += len(rows)
        if skip < len(rows):
            items = list(enumerate(rows[skip:], start=row - len(rows) + skip + 1))
            yield SourceBatch(url, items, Position(row, row + 1))


READER = Parquet()
