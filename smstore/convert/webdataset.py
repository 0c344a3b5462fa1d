"""WebDataset tar shards -> one ``wds`` record per sample ({extension: bytes}), grouped as WebDataset groups them.

The grouping is webdataset's own (``webdataset.tariterators``: ``tar_file_iterator``,
``base_plus_ext``, ``group_by_keys`` with their defaults): only regular files count; names of the
form ``__*__`` and members under ``__*__/`` are skipped as metadata; a name splits at the first dot
of its last path component into key and extension, and a name with no such dot (``README``,
``.hidden``) is skipped; extensions are lower-cased; consecutive members with one key form a
sample, and a sample never spans two shards. The key is kept as the member ``__key__`` (the bytes
of the name as the tar holds them).

Every header is read with bounded memory and time, whatever it declares: see the docs
(docs/convert.md, "WebDataset") for what is refused that WebDataset would read, and why.
"""

from __future__ import annotations

import io
import os
import re
import tarfile
from collections.abc import Callable, Iterator, Sequence
from typing import IO, Any

from smstore.convert._common import Progress, write_records
from smstore.errors import PackInputError
from smstore.format.samples import encode_sample
from smstore.write.pack import PackStats

__all__ = ["convert_webdataset", "iter_samples"]

# webdataset.tariterators.base_plus_ext and tar_file_iterator's default skip_meta, verbatim: the
# same regular expressions give the same answer for every odd name (newlines and dotted folders).
_BASE_PLUS_EXT = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
_SKIP_META = re.compile(r"__[^/]*__($|/)")
# Keys group_by_keys sets itself: a member with one of these extensions collides with them there.
_RESERVED = frozenset({"__key__", "__url__", "__local_path__"})
_MAX_NAME = 0xFFFF  # a wds record's member names are at most this many bytes (smstore/format/samples.py)
# Extended headers (pax, GNU long names) are read whole: 64 KiB holds any real name, and one longer
# than a record can name.
_MAX_HEADER = 1 << 16
# Before Python 3.11.10 / 3.12.6 (CVE-2024-6232) tarfile parses pax headers with regular expressions
# that take quadratic time on malformed records or long runs of digits (13 s for one 64 KiB header):
# each is checked first in linear time, and refused for either.
_DIGIT_RUN = re.compile(rb"[0-9]{256}")
_PAX = (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE)
_MAX_GLOBAL_RECORDS = 256  # tarfile copies the global pax records into every member that follows
_SKIP_CHUNK = 1 << 20
_EXTENDED = {
    tarfile.GNUTYPE_LONGNAME: "GNU long-name",
    tarfile.GNUTYPE_LONGLINK: "GNU long-link",
    tarfile.XHDTYPE: "pax",
    tarfile.XGLTYPE: "pax global",
    tarfile.SOLARIS_XHDTYPE: "pax",
}
_SPARSE = (
    "a sparse file (GNU tar --sparse): most of its bytes are holes the tar does not hold, so a "
    "few KB can declare any size; smstore does not expand them. Re-create the tar without --sparse"
)
# typeshed names only HeaderError; these are the kinds next() turns into a silent end of the archive.
_NO_HEADER: type[Exception] = tarfile.EmptyHeaderError  # type: ignore[attr-defined]
_SHORT_HEADER: type[Exception] = tarfile.TruncatedHeaderError  # type: ignore[attr-defined]
_BAD_HEADER: type[Exception] = tarfile.InvalidHeaderError  # type: ignore[attr-defined]


class _Refused(Exception):
    """A header smstore will not read (`name`: the member's, where the header gave it)."""

    def __init__(self, fault: str, name: str | None = None) -> None:
        super().__init__(fault)
        self.fault = fault
        self.name = name


class _Member(tarfile.TarInfo):
    """tarfile's member, checked as it is parsed: what it declares costs no more than what it holds."""

    @classmethod
    def fromtarfile(cls, tar: tarfile.TarFile) -> _Member:
        try:
            member = super().fromtarfile(tar)
        except (_NO_HEADER, _SHORT_HEADER, _BAD_HEADER) as e:
            # TarFile.next() would end the archive here without a word (past its first header), and
            # a shard cut short at a member boundary would convert as a shorter one.
            if tar.offset == 0 and isinstance(e, _NO_HEADER):
                raise _Refused(
                    "no tar header: the file is empty, or compressed data that ends too soon"
                ) from None
            if tar.offset == 0:
                raise _Refused(f"not a tar archive ({e})") from None
            if isinstance(e, _NO_HEADER):
                raise _Refused("the file ends without the tar end-of-archive marker (truncated?)") from None
            if isinstance(e, _SHORT_HEADER):
                raise _Refused("the file ends inside a member header (truncated?)") from None
            raise _Refused(f"a corrupt member header at byte {tar.offset:,} ({e})") from None
        if member.size < 0:  # a base-256 or pax size can be negative; tarfile would seek backwards
            raise _Refused(f"its header declares a negative size ({member.size})", member.name)
        return member

    def _proc_member(self, tar: tarfile.TarFile) -> _Member:
        kind = _EXTENDED.get(self.type)
        if self.size < 0:
            raise _Refused(f"its header declares a negative size ({self.size})", self.name)
        if kind is not None and self.size > _MAX_HEADER:
            head = _stream(tar).read(min(self.size, 4096))
            raise _Refused(
                f"its {kind} header holds {self.size:,} bytes; smstore reads names and extended headers "
                f"of at most {_MAX_HEADER:,} bytes",
                _name_in(self.type, head),
            )
        if self.type == tarfile.GNUTYPE_SPARSE:
            raise _Refused(_SPARSE, self.name)  # before tarfile reads its map of holes
        if self.type not in _PAX:
            member: _Member = super()._proc_member(tar)  # type: ignore[misc]  # typeshed omits it
            return member
        # tarfile's _proc_pax reads the header itself: read it first, check it, then give it back.
        t: Any = tar
        stream = t.fileobj
        data = stream.read(-(-self.size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE)
        fault = _pax_fault(data[: self.size], self.size)
        if fault is not None:
            raise _Refused(f"its pax header {fault}", _name_in(self.type, data))
        t.fileobj = _Replay(stream, data)
        try:
            member = super()._proc_member(tar)  # type: ignore[misc]
        finally:
            t.fileobj = stream
        return member

    def _refuse_sparse(self, member: tarfile.TarInfo, pax: dict[str, str], *_: object) -> None:
        # The pax forms of sparse files (GNU sparse 0.0, 0.1, 1.0; 1.0 keeps its map in the member's
        # data, as long as it likes): refused before tarfile reads the map. The loop checks
        # issparse() as well, should a later tarfile rename these.
        raise _Refused(_SPARSE, pax.get("GNU.sparse.name") or pax.get("path") or member.name)

    _proc_gnusparse_00 = _proc_gnusparse_01 = _proc_gnusparse_10 = _refuse_sparse


class _Replay:
    """A tar's stream that first gives back `head`, bytes already read from it."""

    def __init__(self, stream: Any, head: bytes) -> None:
        self.stream = stream
        self.head = head

    def read(self, size: int) -> bytes:
        if not self.head:
            data: bytes = self.stream.read(size)
            return data
        out, self.head = self.head[:size], self.head[size:]
        return out + self.stream.read(size - len(out)) if len(out) < size else out

    def tell(self) -> int:
        position: int = self.stream.tell()
        return position - len(self.head)


def _lenient_pax_records() -> bool:
    """Whether this Python's tarfile reads pax records leniently, as before Python 3.11.10 / 3.12.6.

    It then reads a record whose length runs past the header (the value cut at the header's end)
    or that does not end in a newline, and stops at anything that is not a record; later ones
    refuse such archives. Asked once, of a small tar built here, so the converter accepts what the
    tarfile that WebDataset uses accepts.
    """
    records = b"13 comment=x\n"
    info = tarfile.TarInfo("././@PaxHeader")
    info.type, info.size = tarfile.XHDTYPE, len(records)
    pax = info.tobuf(tarfile.USTAR_FORMAT) + records.replace(b"13", b"14") + b"\0" * (-len(records) % 512)
    body = tarfile.TarInfo("x.txt").tobuf(tarfile.USTAR_FORMAT)
    try:
        with tarfile.open(fileobj=io.BytesIO(pax + body + b"\0" * 1024), mode="r:") as tar:
            return [m.name for m in tar.getmembers()] == ["x.txt"]
    except tarfile.TarError:
        return False


_LENIENT = _lenient_pax_records()


def _pax_fault(data: bytes, size: int) -> str | None:
    """What is wrong with a pax header's records (``"LENGTH KEYWORD=VALUE\\n"``), if anything."""
    if len(data) < size:
        return "is cut short (truncated?)"
    pos = 0
    while pos < size and data[pos]:  # tarfile stops at a NUL too
        space = data.find(b" ", pos, pos + 21)
        digits = data[pos:space]
        end = pos + int(digits) if space > pos and digits.isdigit() else -1
        if _LENIENT and end != pos:
            # Read as this tarfile reads it: no record there ends the records (no fault); a record
            # need not end in a newline, and one running past the header ends them. Only a "="
            # beyond the record's length is refused: that regex match spans records (quadratic).
            if end < 0 or data[space + 1 : space + 2] == b"=" or data.find(b"=", space + 2) < 0:
                break
            if data.find(b"=", space + 2, min(end, size)) < 0:
                return f"has a malformed record at byte {pos:,}"
            if end >= size:
                break
            pos = end
            continue
        if not pos < end <= size or data[end - 1] != 0x0A or data.find(b"=", space + 2, end) < 0:
            return f"has a malformed record at byte {pos:,}"
        pos = end
    if _DIGIT_RUN.search(data):
        return "holds a run of 256 or more digits (quadratic to parse for tarfile before Python 3.11.10)"
    return None


def _stream(tar: tarfile.TarFile) -> Any:
    """The tar's decompressed stream (tarfile's ``_Stream`` in ``r|`` mode)."""
    return tar.fileobj


def _name_in(kind: bytes, head: bytes) -> str | None:
    """The member name at the start of an extended header's data, if it holds one."""
    if kind == tarfile.GNUTYPE_LONGNAME:
        name = head.split(b"\0", 1)[0]
    elif kind in (tarfile.XHDTYPE, tarfile.SOLARIS_XHDTYPE) and (at := head.find(b" path=")) >= 0:
        name = head[at + 6 :].split(b"\n", 1)[0]
    else:
        return None
    return name.decode("utf-8", "surrogateescape")


def _show(name: str) -> str:
    """A member's name for a message: its repr, cut short if long."""
    return repr(name) if len(name) <= 120 else f"{name[:100]!r}..."


def _is_meta(name: str) -> bool:
    """tar_file_iterator's metadata test (``__*__`` names, members under ``__*__/``)."""
    if "/" not in name and name.startswith("__") and name.endswith("__"):
        return True
    return _SKIP_META.match(name) is not None


def _why(e: BaseException) -> str:
    if isinstance(e, RecursionError):  # tarfile recurses once per extended header before a member
        return "a chain of extended headers too long to follow"
    return str(e) or type(e).__name__


class _Shard:
    """One tar read member by member, every fault raised as a PackInputError naming file and member."""

    def __init__(self, path: str, raw: IO[bytes]) -> None:
        self.path = path
        self.last = ""  # the last member read whole, for faults between members
        try:
            # r|*: read as WebDataset reads it, a stream (compressed or not), one member at a time.
            self.tar = tarfile.open(  # noqa: SIM115 - a view of `raw`, which the caller closes
                fileobj=raw, mode="r|*", tarinfo=_Member, encoding="utf-8", errors="surrogateescape"
            )
        except Exception as e:  # noqa: BLE001 - as in members(): every fault of the file is one
            raise self._header_fault(e) from None
        self.stream = _stream(self.tar)

    def fault(self, member: tarfile.TarInfo, what: str) -> PackInputError:
        return PackInputError(f"{self.path}: member {_show(member.name)}: {what}")

    def _after(self) -> str:
        return f" after member {_show(self.last)}" if self.last else ""

    def _header_fault(self, e: Exception) -> PackInputError:
        """A fault in the headers after the last member read: the member it names, or that one."""
        if isinstance(e, _Refused) and e.name is not None:
            return PackInputError(f"{self.path}: member {_show(e.name)}: {e.fault}")
        if isinstance(e, _Refused) and self.last:
            return PackInputError(f"{self.path}: after member {_show(self.last)}: {e.fault}")
        if isinstance(e, _Refused):
            return PackInputError(f"{self.path}: {e.fault}")
        return PackInputError(f"{self.path}: corrupt or truncated tar{self._after()}: {_why(e)}")

    def members(self) -> Iterator[tarfile.TarInfo]:
        """Each member's header, its data not yet read: `read` it, or move on and it is skipped."""
        while True:
            try:
                member = self.tar.next()
            except Exception as e:  # noqa: BLE001
                # tarfile parses hostile headers with IndexError, ValueError, RecursionError, zlib
                # and lzma errors as well as its own: every one of them is a fault of the file.
                raise self._header_fault(e) from None
            if member is None:
                return
            # TarFile keeps every member it has seen (webdataset clears it the same way).
            self.tar.members.clear()  # type: ignore[attr-defined]  # typeshed omits it
            if len(self.tar.pax_headers) > _MAX_GLOBAL_RECORDS:
                raise self.fault(member, f"its global pax headers hold over {_MAX_GLOBAL_RECORDS} records")
            yield member
            self._skip_rest(member)
            self.last = member.name

    def read(self, member: tarfile.TarInfo) -> bytes:
        """The data of a regular member."""
        data: bytes | None = None
        try:
            data = self.stream.read(member.size)
        except MemoryError:
            pass  # raised below, once this exception (and the frames holding what was read) is gone
        except Exception as e:  # noqa: BLE001 - a decompressor's error, or tarfile's
            raise self._data_fault(member, _why(e)) from None
        if data is None:
            raise self.fault(member, f"its {member.size:,} bytes do not fit in memory")
        if len(data) != member.size:
            raise self._data_fault(member, f"unexpected end of data ({len(data):,} of {member.size:,} bytes)")
        return data

    def _data_fault(self, member: tarfile.TarInfo, why: str) -> PackInputError:
        return PackInputError(
            f"{self.path}: corrupt or truncated tar{self._after()}: reading member {_show(member.name)}: {why}"
        )

    def _skip_rest(self, member: tarfile.TarInfo) -> None:
        """Read past what is left of the member, in bounded chunks, to the next header.

        TarFile.next() would seek there itself, one empty read per 10 KB however far past the end of
        the file a header points: a size of 2**80 would take forever.
        """
        left = self.tar.offset - self.stream.tell()
        try:
            while left > 0:
                got = len(self.stream.read(min(left, _SKIP_CHUNK)))
                if not got:
                    break
                left -= got
        except Exception as e:  # noqa: BLE001 - a decompressor's error, or tarfile's
            raise self._data_fault(member, _why(e)) from None
        if left > 0:
            raise self._data_fault(member, f"it runs {left:,} bytes past the end of the file")


def iter_samples(path: str, done: Callable[[int], Any] | None = None) -> Iterator[dict[str, bytes]]:
    """The samples of one tar shard, in order, as WebDataset reads them: ``{"__key__": key, ext: bytes, ...}``.

    Args:
        path: The tar (plain, or compressed with gzip, bzip2 or xz).
        done: Called after each member with the bytes of the file read so far.

    Raises:
        PackInputError: A truncated or corrupt tar, or a member smstore will not store (a sparse
            file, two members of one sample with one extension, an extension a ``wds`` record cannot
            name), naming the file and the member.
    """
    try:
        raw = open(path, "rb")  # noqa: SIM115  # closed by the with below, also on a fault in _Shard
    except OSError as e:
        raise PackInputError(f"{path}: cannot read: {e.strerror}") from None
    with raw:
        shard = _Shard(path, raw)
        key: str | None = None
        sample: dict[str, bytes] = {}
        for member in shard.members():
            name = member.name
            if not member.isreg() or _is_meta(name) or not (split := _BASE_PLUS_EXT.match(name)):
                continue  # skipped by WebDataset: links, folders, devices; metadata; no extension
            if member.issparse():
                raise shard.fault(member, _SPARSE)
            k, ext = split.group(1), split.group(2).lower()
            if k != key:
                if sample:
                    yield sample
                # The name's own bytes: tarfile decodes names that are not UTF-8 with surrogateescape.
                sample = {"__key__": k.encode("utf-8", "surrogateescape")}
                key = k
            if ext in _RESERVED:
                raise shard.fault(member, f"extension {ext!r} is a name WebDataset gives its own metadata")
            if ext in sample:
                raise shard.fault(member, f"sample {_show(k)} already has a member with extension {ext!r}")
            try:
                size = len(ext.encode())
            except UnicodeEncodeError:
                msg = f"its extension {ext!r} is not UTF-8 (a wds record names members in UTF-8)"
                raise shard.fault(member, msg) from None
            if size > _MAX_NAME:
                msg = f"its extension is {size:,} bytes, more than the {_MAX_NAME:,} a wds record can name"
                raise shard.fault(member, msg)
            sample[ext] = shard.read(member)
            if done is not None:
                done(raw.tell())
    if sample:
        yield sample


def convert_webdataset(
    sources: Sequence[str | os.PathLike[str]],
    output: str | os.PathLike[str],
    *,
    metadata: dict[str, Any] | None = None,
    shard_size: int | None = None,
    durable: bool = True,
    progress: bool | None = None,
) -> PackStats:
    """Convert WebDataset tar shards (read in order) into a blob of ``wds`` records.

    ``smstore.open()`` and ``SharedStoreDataset`` decode each record to ``{ext: bytes}`` (with
    ``__key__``); ``Store(path)[i]`` is the raw record (format: smstore/format/samples.py).
    """
    paths = [os.fspath(p) for p in sources]
    if not paths:
        raise PackInputError("convert_webdataset needs at least one tar shard")
    for p in paths:
        if not os.path.isfile(p):
            raise PackInputError(f"{p}: no such file")
    sizes = [os.path.getsize(p) for p in paths]
    bar = Progress(sum(sizes), progress, "convert")

    def records() -> Iterator[bytes]:
        before = 0
        for p, size in zip(paths, sizes, strict=True):

            def done(n: int, before: int = before) -> None:
                bar.update(before + n)

            for sample in iter_samples(p, done):
                yield encode_sample(sample)
            before += size

    return write_records(
        records(),
        output,
        encoding="wds",
        source=paths,
        metadata=metadata,
        durable=durable,
        shard_size=shard_size,
        input_bytes=sum(sizes),
        bar=bar,
    )
