"""String ``format``s as regular languages: each regex (Python syntax, matched in full) is a subset of what its RFC
allows, written in one common spelling; :data:`FORMATS` is what the compiler writes, and a format outside it is an
annotation (ignored and reported, or refused when strict).

* ``date``, ``time``, ``date-time``, ``duration``: RFC 3339 (section 5.6 and appendix A): real calendar dates (leap
  years by the Gregorian rule), times with ``Z`` or a numeric offset, an optional fraction of 3 or 6 digits.
* ``hostname``: RFC 1123 labels (letters, digits and inner hyphens) of at most 20 characters, at most 4 of them
  (so the name is within 253 characters); ``email``: a local part of one or two dot-separated runs of 1 to 16 RFC 5321
  atext characters (within its 64) at such a host name with a top-level label of 2 to 6 letters.
* ``ipv4``: dotted decimal; ``ipv6``: RFC 4291 section 2.2, forms 1 and 2 (hexadecimal groups, ``::``).
* ``uri``, ``iri``: ``http``/``https`` URLs (RFC 3986: host, port, path, query, fragment of unreserved and
  sub-delimiter characters and percent escapes); ``uri-reference``, ``iri-reference``: those, or a relative
  reference (a path, query or fragment); ``uri-template``: RFC 6570 literals and simple expressions.
* ``uuid``: RFC 4122's hexadecimal form (lowercase); ``json-pointer``, ``relative-json-pointer``: RFC 6901 and its
  relative form; ``byte``: base64 (OpenAPI).
"""

from __future__ import annotations

_HOUR, _MINUTE = "(?:[01][0-9]|2[0-3])", "[0-5][0-9]"
_YEAR = "(?:000[1-9]|00[1-9][0-9]|0[1-9][0-9]{2}|[1-9][0-9]{3})"
_LEAP_YEAR = "(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_DATE = (
  f"(?:{_YEAR}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
  f"|02-(?:0[1-9]|1[0-9]|2[0-8]))|{_LEAP_YEAR}-02-29)"
)
_TIME = f"{_HOUR}:{_MINUTE}:{_MINUTE}(?:\\.[0-9]{{3}}(?:[0-9]{{3}})?)?(?:Z|[+-]{_HOUR}:{_MINUTE})"
_N = "[0-9]{1,6}"
_DUR_TIME = f"T(?:{_N}H(?:{_N}M(?:{_N}S)?)?|{_N}M(?:{_N}S)?|{_N}S)"
_DURATION = f"P(?:(?:{_N}D|{_N}M(?:{_N}D)?|{_N}Y(?:{_N}M(?:{_N}D)?)?)(?:{_DUR_TIME})?|{_DUR_TIME}|{_N}W)"
_LABEL = "[A-Za-z0-9](?:[A-Za-z0-9-]{0,18}[A-Za-z0-9])?"
_HOSTNAME = f"{_LABEL}(?:\\.{_LABEL}){{0,3}}"
_ATEXT = "[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]"
_EMAIL = f"{_ATEXT}{{1,16}}(?:\\.{_ATEXT}{{1,16}})?@(?:{_LABEL}\\.){{1,3}}[A-Za-z]{{2,6}}"
_OCTET = "(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
_IPV4 = f"{_OCTET}(?:\\.{_OCTET}){{3}}"
_H = "[0-9a-f]{1,4}"
_IPV6 = (
  f"(?:(?:{_H}:){{7}}{_H}|(?:{_H}:){{1,7}}:|(?:{_H}:){{1,6}}:{_H}|(?:{_H}:){{1,5}}(?::{_H}){{1,2}}"
  f"|(?:{_H}:){{1,4}}(?::{_H}){{1,3}}|(?:{_H}:){{1,3}}(?::{_H}){{1,4}}|(?:{_H}:){{1,2}}(?::{_H}){{1,5}}"
  f"|{_H}:(?::{_H}){{1,6}}|:(?:(?::{_H}){{1,7}}|:))"
)
_PCHAR = "(?:[A-Za-z0-9._~!$&'()*+,;=:@-]|%[0-9A-F]{2})"
_PATH = f"(?:/{_PCHAR}*)*"
_QUERY = f"(?:\\?(?:{_PCHAR}|[/?])*)?(?:#(?:{_PCHAR}|[/?])*)?"
_URI = f"https?://{_HOSTNAME}(?::[0-9]{{1,5}})?{_PATH}{_QUERY}"
_SEGMENT_NC = "(?:[A-Za-z0-9._~!$&'()*+,;=@-]|%[0-9A-F]{2})+"  # a first segment without ':' (not a scheme)
_RELATIVE = f"(?:/(?:{_PCHAR}+{_PATH})?|{_SEGMENT_NC}{_PATH})?{_QUERY}"
_VARIABLE = "[A-Za-z0-9_]+(?::[1-9][0-9]{0,3}|\\*)?"
_TEMPLATE = f"(?:[A-Za-z0-9._~!$&'()*+,;=:@/?#%-]|\\{{[+#./;?&]?{_VARIABLE}(?:,{_VARIABLE})*\\}})*"
_POINTER = "(?:/(?:[^~/]|~[01])*)*"
_BASE64 = "(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?"

FORMATS = {
  "date": _DATE,
  "time": _TIME,
  "date-time": f"{_DATE}T{_TIME}",
  "duration": _DURATION,
  "hostname": _HOSTNAME,
  "email": _EMAIL,
  "ipv4": _IPV4,
  "ipv6": _IPV6,
  "uri": _URI,
  "iri": _URI,
  "uri-reference": f"(?:{_URI}|{_RELATIVE})",
  "iri-reference": f"(?:{_URI}|{_RELATIVE})",
  "uri-template": _TEMPLATE,
  "uuid": "[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}",
  "json-pointer": _POINTER,
  "relative-json-pointer": f"(?:0|[1-9][0-9]*)(?:#|{_POINTER})",
  "byte": _BASE64,
}

# OpenAPI's formats of numbers and opaque strings: annotations the compiler knows (no warning).
ANNOTATIONS = frozenset(["int32", "int64", "float", "double", "password", "binary"])
