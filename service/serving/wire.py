"""Which field of a protobuf message holds the bytes that are not UTF-8.

protobuf refuses a proto3 `string` field that is not valid UTF-8 with a DecodeError that names no
field. This walks the wire format (tag, wire type, payload) against the message's descriptor and
names the first such field as the codec would: `samples[2].text`, `prompt.text`. Only called on a
message that failed to parse, so its cost is never paid by a valid request.
"""

from __future__ import annotations

from google.protobuf.descriptor import Descriptor, FieldDescriptor

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5


def invalid_utf8_field(descriptor: Descriptor, raw: bytes) -> tuple[str, str] | None:
    """(field path, what is wrong) for the first string field that is not UTF-8; None if there is
    none, or the bytes are not a well-formed message at all."""
    try:
        return _walk(descriptor, memoryview(raw), "")
    except _Malformed:
        return None


class _Malformed(Exception):
    pass


def _varint(data: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise _Malformed
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _walk(descriptor: Descriptor, data: memoryview, prefix: str) -> tuple[str, str] | None:
    seen: dict[int, int] = {}  # field number -> elements of a repeated field so far
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire_type = key >> 3, key & 7
        if wire_type == _VARINT:
            _, pos = _varint(data, pos)
            continue
        if wire_type in (_I64, _I32):
            pos += 8 if wire_type == _I64 else 4
            continue
        if wire_type != _LEN:
            raise _Malformed  # groups: not in our protos
        length, pos = _varint(data, pos)
        payload = data[pos:pos + length]
        pos += length
        if pos > len(data):
            raise _Malformed
        field = descriptor.fields_by_number.get(number)
        if field is None or field.type not in (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_MESSAGE):
            continue  # unknown fields, bytes, packed numbers
        name = prefix + field.name
        if field.is_repeated:
            name += f"[{seen.get(number, 0)}]"
            seen[number] = seen.get(number, 0) + 1
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            found = _walk(field.message_type, payload, name + ".")
            if found is not None:
                return found
            continue
        try:
            bytes(payload).decode("utf-8")
        except UnicodeDecodeError as e:
            return name, f"is not valid UTF-8 (byte 0x{payload[e.start]:02x} at offset {e.start} of {length})"
    return None
