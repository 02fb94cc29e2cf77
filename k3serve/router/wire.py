"""A request deserializer that never fails: undecodable bytes become an ``Undecodable`` naming the problem.

grpcio turns a deserializer exception into INTERNAL "Exception deserializing request!", and protobuf refuses a
``string`` field that is not valid UTF-8. The client sent a bad request, which is INVALID_ARGUMENT naming the
field, so the router registers its methods with ``tolerant(...)`` and the handler answers ``Undecodable``.
"""

from __future__ import annotations

from dataclasses import dataclass

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError


@dataclass(frozen=True)
class Undecodable:
    """Bytes that do not parse as the method's request message; ``problem`` names the field when it can."""

    problem: str


def _varint(data: bytes, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        if i >= len(data) or shift > 63:
            raise ValueError("truncated varint")
        b = data[i]
        value |= (b & 0x7F) << shift
        i += 1
        if not b & 0x80:
            return value, i
        shift += 7


def _bad_string_field(data: bytes, descriptor) -> str | None:
    """The first string field (top level or nested message, dotted path) holding invalid UTF-8, if any."""
    i = 0
    try:
        while i < len(data):
            tag, i = _varint(data, i)
            number, wire = tag >> 3, tag & 7
            if wire == 0:
                _, i = _varint(data, i)
            elif wire == 1:
                i += 8
            elif wire == 5:
                i += 4
            elif wire == 2:
                n, i = _varint(data, i)
                body, i = data[i:i + n], i + n
                field = descriptor.fields_by_number.get(number)
                if field is None:
                    continue
                if field.type == FieldDescriptor.TYPE_STRING:
                    try:
                        body.decode("utf-8")
                    except UnicodeDecodeError:
                        return field.name
                elif field.type == FieldDescriptor.TYPE_MESSAGE:
                    inner = _bad_string_field(body, field.message_type)
                    if inner:
                        return f"{field.name}.{inner}"
            else:
                return None
    except ValueError:
        return None
    return None


def tolerant(message_cls):
    """A request_deserializer for ``message_cls`` that returns ``Undecodable`` instead of raising."""

    def parse(data: bytes):
        try:
            return message_cls.FromString(data)
        except DecodeError:
            field = _bad_string_field(data, message_cls.DESCRIPTOR)
            if field:
                return Undecodable(f"{field} is not valid UTF-8 (a proto3 string must be)")
            return Undecodable(f"the request is not a valid {message_cls.DESCRIPTOR.full_name}")

    return parse
