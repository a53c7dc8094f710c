"""Personal data replaced by placeholders: e-mail addresses, IP addresses and phone numbers.

Conservative, to leave numbers that are not personal data alone:
- e-mail: name@domain.tld, except where the "top-level domain" is a file extension
  (`logo@2x.png`);
- IP: IPv4 dotted quads and IPv6 addresses of three groups or more, replaced only when Python's
  `ipaddress` reads them as a valid, globally routed address (as datatrove does: private,
  loopback and documentation addresses are not anyone's);
- phone: an international number written with `+` and its country code, or a North American
  one written `(555) 123-4567`, `555-123-4567` or `555.123.4567` (one separator throughout).
  Numbers separated by spaces alone (`2018 2019 2020`, `100 200 3000`) are not phone numbers.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

_FILE_EXTENSIONS = "png|jpe?g|gif|svg|webp|bmp|ico|pdf|js|css|html?|txt|zip|gz|mp[34]|wav|tiff?"
_EMAIL = re.compile(
    r"(?<![\w.+-])[\w.+-]+@(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?\.)+"
    rf"(?!(?:{_FILE_EXTENSIONS})\b)[A-Za-z]{{2,}}\b",
    re.IGNORECASE,
)
_IPV4 = re.compile(r"(?<![\w.])\d{1,3}(?:\.\d{1,3}){3}(?![\w.]\d|\w)")
_IPV6 = re.compile(r"(?<![\w:])[0-9A-Fa-f]{0,4}(?::[0-9A-Fa-f]{0,4}){2,7}(?![\w:])")
_PHONE = re.compile(
    r"(?<![\w+])(?:"
    r"\+\d{1,3}[ .-]?(?:\(\d{1,4}\)|\d{1,4})(?:[ .-]\d{2,4}){2,3}"  # +44 20 7946 0958
    r"|\(\d{3}\) ?\d{3}-\d{4}"  # (555) 123-4567
    r"|\d{3}(?P<sep>[-.])\d{3}(?P=sep)\d{4}"  # 555-123-4567, 555.123.4567
    r")(?!\w)"
)


@dataclass(frozen=True)
class PII:
    email: str | None = "<EMAIL>"  # the placeholder; None leaves them
    ip_address: str | None = "<IP_ADDRESS>"
    phone_number: str | None = "<PHONE_NUMBER>"


def _global_ip(text: str) -> bool:
    if text.count(":") and sum(1 for group in text.split(":") if group) < 3:
        return False
    try:
        return ipaddress.ip_address(text).is_global
    except ValueError:
        return False


def replace_pii(text: str, c: PII) -> tuple[str, int]:
    """(the text with placeholders, how many were replaced)."""
    total = 0

    def ip(match: re.Match) -> str:
        nonlocal total
        if not _global_ip(match.group(0)):
            return match.group(0)
        total += 1
        return c.ip_address

    for pattern, placeholder in ((_EMAIL, c.email), (_PHONE, c.phone_number)):
        if placeholder is not None:
            text, count = pattern.subn(placeholder, text)
            total += count
    if c.ip_address is not None:
        text = _IPV6.sub(ip, _IPV4.sub(ip, text))
    return text, total
