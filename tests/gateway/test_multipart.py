"""gateway.multipart: the `model` field of a multipart/form-data body, found in one bounded pass."""

from __future__ import annotations

import pytest

from gateway.multipart import InvalidMultipart, ModelFieldTooLong, is_multipart, multipart_model

CT = b"multipart/form-data; boundary=XyZ"


def form(*parts: tuple[bytes, bytes], boundary: bytes = b"XyZ", eol: bytes = b"\r\n") -> bytes:
    out = b""
    for disposition, value in parts:
        out += b"--" + boundary + eol + b"Content-Disposition: form-data; " + disposition + eol + eol + value + eol
    return out + b"--" + boundary + b"--" + eol


FILE = (b'name="file"; filename="a.wav"', b"RIFF\x00\xff--XyNot\r\n--Xy\nbinary")


def test_the_model_field_is_found_among_file_parts_first_middle_or_last() -> None:
    model = (b'name="model"', b"whisper-1")
    for parts in ((model, FILE), (FILE, model), (FILE, model, (b'name="language"', b"en"))):
        assert multipart_model(CT, form(*parts), 256) == "whisper-1"


def test_bare_lf_lines_padding_a_preamble_and_an_epilogue_are_read() -> None:
    assert multipart_model(CT, form(FILE, (b'name="model"', b"m"), eol=b"\n"), 256) == "m"
    padded = form(FILE, (b"name=model", b"m")).replace(b"--XyZ\r\n", b"--XyZ \t\r\n")
    assert multipart_model(CT, b"preamble\r\n" + padded + b"epilogue", 256) == "m"


@pytest.mark.parametrize("content_type", [
    b'multipart/form-data; boundary="XyZ"', b"Multipart/Form-Data;charset=utf-8;  BOUNDARY = XyZ",
])
def test_quoted_and_spaced_boundaries(content_type: bytes) -> None:
    assert is_multipart(content_type)
    assert multipart_model(content_type, form((b'name="model"', b"m")), 256) == "m"


def test_a_body_without_a_model_field_names_none() -> None:
    assert multipart_model(CT, form(FILE), 256) == ""
    # A file part named model is a file, not the field.
    assert multipart_model(CT, form((b'name="model"; filename="m.txt"', b"m")), 256) == ""


@pytest.mark.parametrize("content_type, body", [
    (b"multipart/form-data", form((b'name="model"', b"m"))),  # no boundary
    (b"multipart/form-data; boundary=", form((b'name="model"', b"m"))),
    (b"multipart/form-data; boundary=" + b"x" * 71, form((b'name="model"', b"m"), boundary=b"x" * 71)),  # > RFC 2046
    (b'multipart/form-data; boundary="' + b"x" * 71 + b'"', form((b'name="model"', b"m"), boundary=b"x" * 71)),
    (CT, b"model=m"),  # no delimiter at all
    (CT, b"--XyZ\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nm"),  # never closed
    (CT, b"--XyZ\r\nContent-Disposition: form-data; name=\"model\"\r\nm\r\n--XyZ--"),  # no blank line
    (CT, b"--XyZjunk\r\n\r\nm\r\n--XyZ--"),  # a delimiter not ending its line
    (CT, form((b'name="model"', b"a"), (b'name="model"', b"b"))),  # ambiguous
    (CT, form((b'name="model"', b"\xff\xfe"))),  # not UTF-8
])
def test_malformed_bodies_are_refused(content_type: bytes, body: bytes) -> None:
    with pytest.raises(InvalidMultipart):
        multipart_model(content_type, body, 256)


def test_a_model_field_over_the_limit_is_refused_without_copying_it() -> None:
    assert multipart_model(CT, form((b'name="model"', b"m" * 256)), 256) == "m" * 256
    with pytest.raises(ModelFieldTooLong):
        multipart_model(CT, form((b'name="model"', b"m" * 257)), 256)


def test_endless_part_headers_are_refused() -> None:
    body = b"--XyZ\r\nX-Pad: " + b"a" * 20000 + b"\r\n\r\nm\r\n--XyZ--\r\n"
    with pytest.raises(InvalidMultipart):
        multipart_model(CT, body, 256)


def test_a_body_of_tiny_parts_is_refused_after_max_parts_in_bounded_work() -> None:
    """8 MiB of 9-byte parts (issue 38, row 4: ~2 s of one loop per body): refused at MAX_PARTS + 1,
    its work bounded by the count (CPU time of this thread, not the wall clock)."""
    import time

    from gateway.multipart import MAX_PARTS

    boundary = b"b"
    part = b"--b\r\n\r\nx\r\n"
    body = part * (8 * 1024 * 1024 // len(part)) + b"--b--\r\n"
    started = time.thread_time()
    with pytest.raises(InvalidMultipart, match=f"more than {MAX_PARTS} parts"):
        multipart_model(b"multipart/form-data; boundary=" + boundary, body, 256)
    assert time.thread_time() - started < 0.05  # a few scans per part, 65 parts
    ok = b"--b\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nm\r\n" + part * (MAX_PARTS - 1) + b"--b--\r\n"
    assert multipart_model(b"multipart/form-data; boundary=b", ok, 256) == "m"
