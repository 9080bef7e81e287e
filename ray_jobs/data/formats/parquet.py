"""Parquet: row ranges a worker reads itself, planned from the file's footer (small row groups together, big ones
cut), decoding only the row groups a range lies in."""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import IO, Any

from ray_jobs.data.formats.base import Position, SourceBatch, SourceFile, SourceUnreadable, Unit, readable, row_batches
from ray_jobs.storage import fs_and_path


class Parquet:
    name: str = "parquet"
    suffixes: tuple[str, ...] = (".parquet",)
    unit: Unit = "row"
    listed: bool = True
    splittable: bool = True

    def batches(
        self, url: str, f: IO[bytes], start: Position, batch_bytes: int, max_chars: int | None
    ) -> Iterator[SourceBatch]:
        import pyarrow.parquet as pq

        with readable(url, "Parquet"):
            yield from row_batches(url, pq.ParquetFile(f).iter_batches(batch_size=8192), start)

    def read_range(
        self, url: str, f: IO[bytes], start: int, stop: int | None, max_chars: int | None
    ) -> tuple[list[tuple[int, Any]], int]:
        """Rows [start, stop), decoding only the row groups they lie in."""
        import pyarrow.parquet as pq

        with readable(url, "Parquet"):
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

        with readable(src.url, "Parquet"):
            return pq.read_table(io.BytesIO(src.data)).to_pylist()

    def columns(self, url: str) -> list[str] | None:
        import pyarrow.parquet as pq

        fs, path = fs_and_path(url)
        try:
            with fs.open(path, "rb") as f, readable(url, "Parquet"):
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
        with fs.open(path, "rb") as f, readable(url, "Parquet"):
            return pq.ParquetFile(f).metadata
    except OSError as e:
        raise SourceUnreadable(f"{url}: cannot read: {e}") from e


READER = Parquet()
