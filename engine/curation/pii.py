"""Personal data replaced by placeholders: e-mail addresses, IP addresses and phone numbers."""

from __future__ import annotations

import re
from dataclasses import dataclass

_EMAIL = re.compile(
    r"(?<![\w.+-])[\w.+-]+@(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?\.)+[A-Za-z]{2,}\b"
)
_OCTET = r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
_IPV4 = re.compile(rf"(?<![\w.]){_OCTET}(?:\.{_OCTET}){{3}}(?![\w.]\d)")
_IPV6 = re.compile(r"(?<![\w:])(?:[0-9A-Fa-f]{1,4}:){7}[0-9A-Fa-f]{1,4}(?![\w:])")
# +1 (555) 123-4567, 555-123-4567, 555.123.4567, +44 20 7946 0958: separators required, so
# that plain numbers (years, counts, ids) are left alone
_PHONE = re.compile(
    r"(?<![\w+])(?:\+\d{1,3}[ .-]?)?(?:\(\d{2,4}\)[ .-]?|\d{2,4}[ .-])\d{3,4}[ .-]\d{4}(?!\w)"
)


@dataclass(frozen=True)
class PII:
    email: str | None = "<EMAIL>"  # the placeholder; None leaves them
    ip_address: str | None = "<IP_ADDRESS>"
    phone_number: str | None = "<PHONE_NUMBER>"


def replace_pii(text: str, c: PII) -> tuple[str, int]:
    """(the text with placeholders, how many were replaced)."""
    total = 0
    for pattern, placeholder in (
        (_EMAIL, c.email),
        (_IPV6, c.ip_address),
        (_IPV4, c.ip_address),
        (_PHONE, c.phone_number),
    ):
        if placeholder is not None:
            text, count = pattern.subn(placeholder, text)
            total += count
    return text, total
