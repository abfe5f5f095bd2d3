"""The edit's multipart body, read as it streams and bounded part by part: a file part past its
limit, a text field past the form's text budget, one part too many or a field that is not UTF-8
stops the read at once (the client's remaining bytes are never read: the answer closes the
connection). So a burst of oversized uploads costs at most their limits, not their size.

Text fields follow the JSON route's rules: their bytes together are bounded by
`--max-body-bytes` (the JSON body's limit) and they must be UTF-8, as a JSON body must.
Starlette's form parser is not used: it spools any file whole and decodes text that is not
UTF-8 as Latin-1, silently.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.requests import ClientDisconnect, Request

from server.api.errors import APIError
from server.errors import InvalidRequest

MAX_PART_HEADER_BYTES = 8 * 1024  # a part's headers: a Content-Disposition and a Content-Type


@dataclass
class FormLimits:
    max_file_bytes: int  # each file
    max_files: tuple[tuple[tuple[str, ...], int, str | None], ...]  # (fields, their bound, its setting)
    max_text_bytes: int  # every text field's name and value, together
    max_fields: int


@dataclass
class Form:
    fields: dict[str, str] = field(default_factory=dict)
    files: dict[str, list[bytes]] = field(default_factory=dict)


def _unparsable(why: str) -> APIError:
    message = (
        f"the request body cannot be parsed ({why}): send a multipart/form-data body, as OpenAI's SDKs send"
    )
    return APIError(400, message, code="invalid_body")


class _Reader:
    def __init__(self, limits: FormLimits) -> None:
        self.limits, self.form = limits, Form()
        self.field_bytes, self.value_bytes, self.header_bytes = b"", b"", 0
        self.disposition = b""
        self.name: str | None = None
        self.is_file = False
        self.chunks: list[bytes] = []  # joined once, at the part's end: no growing buffer copied
        self.size = 0
        self.text_bytes = 0

    def part_begin(self) -> None:
        self.disposition, self.header_bytes, self.name = b"", 0, None
        self.chunks, self.size = [], 0

    def header_field(self, data: bytes, start: int, end: int) -> None:
        self._count_header(end - start)
        self.field_bytes += data[start:end]

    def header_value(self, data: bytes, start: int, end: int) -> None:
        self._count_header(end - start)
        self.value_bytes += data[start:end]

    def _count_header(self, size: int) -> None:
        self.header_bytes += size
        if self.header_bytes > MAX_PART_HEADER_BYTES:
            raise _unparsable(f"a part's headers are over {MAX_PART_HEADER_BYTES} bytes")

    def header_end(self) -> None:
        if self.field_bytes.lower() == b"content-disposition":
            self.disposition = self.value_bytes
        self.field_bytes, self.value_bytes = b"", b""

    def headers_finished(self) -> None:
        _, options = parse_options_header(self.disposition)
        if b"name" not in options:
            raise _unparsable("a part has no Content-Disposition name")
        try:
            name = options[b"name"].decode("utf-8")
        except UnicodeDecodeError:
            raise _unparsable("a field's name is not UTF-8") from None
        self.is_file = b"filename" in options
        if self.is_file != any(name in fields for fields, _, _ in self.limits.max_files):
            raise InvalidRequest(
                name, "must be a file" if self.is_file is False else "must be a text field, not a file"
            )
        if self.is_file:
            fields, bound, setting = next(g for g in self.limits.max_files if name in g[0])
            if sum(len(self.form.files.get(f, ())) for f in fields) >= bound:
                raise InvalidRequest(fields[0], f"at most {bound} a request", setting)
            self.form.files.setdefault(name, [])
        else:
            if len(self.form.fields) >= self.limits.max_fields:
                raise InvalidRequest(name, f"more than {self.limits.max_fields} text fields")
            if name in self.form.fields:
                raise InvalidRequest(name, "is given more than once")
            self._count_text(name, len(options[b"name"]))
        self.name = name

    def part_data(self, data: bytes, start: int, end: int) -> None:
        assert self.name is not None  # headers_finished ran
        size = end - start
        if self.is_file:
            if self.size + size > self.limits.max_file_bytes:
                message = f"is over {self.limits.max_file_bytes} bytes, the limit"
                raise InvalidRequest(self.name, message, "DIFFSHARD_MAX_IMAGE_BYTES")
        else:
            self._count_text(self.name, size)
        self.chunks.append(data[start:end])
        self.size += size

    def _count_text(self, name: str, size: int) -> None:
        self.text_bytes += size
        if self.text_bytes > self.limits.max_text_bytes:
            message = f"the form's text fields are over {self.limits.max_text_bytes} bytes, the limit"
            raise InvalidRequest(name, message, "DIFFSHARD_MAX_BODY_BYTES")

    def part_end(self) -> None:
        assert self.name is not None
        if self.is_file:
            self.form.files[self.name].append(b"".join(self.chunks))
        else:
            self.form.fields[self.name] = _text(b"".join(self.chunks), self.name)
        self.chunks, self.size = [], 0


def _text(data: bytes, what: str) -> str:
    """UTF-8 text, as a JSON body must be: anything else is refused, never guessed at."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        message = f"must be UTF-8 text; byte {err.start} is not (send text as UTF-8)"
        raise InvalidRequest(what, message) from None


async def read_form(request: Request, limits: FormLimits) -> Form:
    """The body's fields and files, each within `limits`; InvalidRequest names the field."""
    _, params = parse_options_header(request.headers.get("content-type", ""))
    boundary = params.get(b"boundary")
    if not boundary:
        raise _unparsable("no multipart boundary in Content-Type")
    reader = _Reader(limits)
    callbacks = {
        "on_part_begin": reader.part_begin,
        "on_part_data": reader.part_data,
        "on_part_end": reader.part_end,
        "on_header_field": reader.header_field,
        "on_header_value": reader.header_value,
        "on_header_end": reader.header_end,
        "on_headers_finished": reader.headers_finished,
    }
    try:
        parser = MultipartParser(boundary, callbacks)  # type: ignore[arg-type]
        async for chunk in request.stream():
            parser.write(chunk)
        parser.finalize()
    except FormParserError as err:
        raise _unparsable(str(err).rstrip(".") or type(err).__name__) from None
    except ClientDisconnect:
        raise APIError(499, "the client disconnected", code="cancelled") from None
    return reader.form
