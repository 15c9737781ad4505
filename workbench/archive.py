"""Reading a zip archive someone else made (an upload), with every limit checked as it inflates.

A zip declares each member's size, and a hostile one lies: a member that declares 1,000 bytes
can inflate to a gibibyte, a flipped byte makes zlib fail mid-stream, and a 2 MB archive can
hold a hundred thousand entries. ``read_zip`` counts the bytes it has inflated against the
limits as it goes (never trusting the declared sizes alone), caps the number of entries, refuses
paths that would leave the target folder, and turns every error the zip and zlib modules can
raise into one ``ArchiveError`` (a ValueError) naming the archive and the member.
"""

from __future__ import annotations

import io
import zipfile
import zlib
from pathlib import PurePosixPath
from typing import Callable, Optional

MAX_ENTRIES = 1000  # a checkpoint or a direction is a handful of files
CHUNK = 1 << 20
# What a corrupt archive raises from the zip and zlib modules (RuntimeError: an encrypted member;
# NotImplementedError: an unknown compression method; EOFError, OSError: a truncated stream).
ARCHIVE_ERRORS = (zipfile.BadZipFile, zipfile.LargeZipFile, zlib.error, EOFError, OSError, RuntimeError,
                  NotImplementedError, ValueError, KeyError, UnicodeDecodeError)


class ArchiveError(ValueError):
    """A zip archive is corrupt, too large when inflated, holds too many entries or an unsafe path."""


def _size(n: int) -> str:
    return f"{n / 2**20:.0f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB" if n >= 2**10 else f"{n} B"


def read_zip(data: bytes, *, name: str = "the .zip file", max_total: int, max_member: Optional[int] = None,
             max_entries: int = MAX_ENTRIES, keep: Callable[[zipfile.ZipInfo], bool] = lambda info: True,
             ) -> dict[str, bytes]:
    """The files of the zip archive ``data`` as {posix path: bytes}, folders left out.

    ``keep`` picks the members to inflate (the others are neither counted nor read). At most
    ``max_entries`` members; each inflates to at most ``max_member`` bytes and all of them to at
    most ``max_total``, counted while inflating. Any failure is an ``ArchiveError`` with one
    message; nothing is half-returned.
    """
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        infos = [i for i in archive.infolist() if not i.is_dir() and keep(i)]
    except ARCHIVE_ERRORS:
        raise ArchiveError(f"{name} is corrupt or not a zip archive") from None
    if len(infos) > max_entries:
        raise ArchiveError(f"{name} holds {len(infos):,} files; at most {max_entries:,} are accepted")
    max_member = max_total if max_member is None else min(max_member, max_total)
    if sum(i.file_size for i in infos) > max_total:  # the declared sizes: refused before inflating anything
        raise ArchiveError(f"{name} unpacks to more than {_size(max_total)}")
    out: dict[str, bytes] = {}
    total = 0
    with archive:
        for info in infos:
            parts = PurePosixPath(info.filename.replace("\\", "/")).parts
            if info.filename.startswith(("/", "\\")) or ".." in parts or not parts or ":" in parts[0]:
                raise ArchiveError(f"{name} holds an unsafe path {info.filename!r}")
            if info.file_size > max_member:
                raise ArchiveError(f"{info.filename} in {name} is {_size(info.file_size)}; the limit is "
                                   f"{_size(max_member)}")
            limit = min(max_member, max_total - total)
            chunks, size = [], 0
            try:
                with archive.open(info) as member:
                    while chunk := member.read(min(CHUNK, limit + 1 - size)):
                        size += len(chunk)
                        if size > limit:  # it declared less: a lie (a bomb), stopped at the limit
                            raise ArchiveError(f"{info.filename} in {name} inflates to more than "
                                               f"{_size(limit)} (it declares {_size(info.file_size)})")
                        chunks.append(chunk)
            except ArchiveError:
                raise
            except ARCHIVE_ERRORS as e:
                raise ArchiveError(f"{info.filename} in {name} is corrupt and cannot be unpacked "
                                   f"({type(e).__name__}: {e})") from None
            total += size
            out["/".join(parts)] = b"".join(chunks)
    return out
