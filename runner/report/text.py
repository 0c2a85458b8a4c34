"""Escaping of hostile strings, one function per medium. Pure."""

from __future__ import annotations

import html
import re

# C0/C1 controls, DEL, bidi overrides/isolates, line/paragraph separators: they can move
# the cursor, recolour a terminal or reorder what a reader sees.
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u2028\u2029\u202a-\u202e"
                      "\u2066-\u2069]")
# XML 1.0 forbids these even as character references.
_XML_BAD = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff\ud800-\udfff]")
# Every value sits mid-line (after "- x: " or in a table cell), so only inline syntax
# needs escaping; '<', '>' and '&' are already entities.
_MD_SPECIAL = re.compile(r"([\\`*_{}\[\]()|~!])")


def visible(text: str) -> str:
    """Controls shown as \\uXXXX; tabs kept, newlines kept."""
    return _CONTROL.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def one_line(text: str, limit: int = 300) -> str:
    """Visible, newlines folded to ' / ', capped: for terminal cells and Markdown."""
    flat = visible(text).replace("\r\n", "\n").replace("\n", " / ").replace("\t", " ")
    return flat if len(flat) <= limit else flat[:limit] + "…"


def md(text: str, limit: int = 300) -> str:
    """Inert Markdown inline text: HTML-escaped, punctuation backslash-escaped, no
    @mentions, one line (safe inside a table cell)."""
    s = html.escape(one_line(text, limit), quote=True)
    s = _MD_SPECIAL.sub(r"\\\1", s)
    return s.replace("@", "&#64;")


def xml(text: str, limit: int = 4000) -> str:
    """Text that is valid in XML 1.0 (ElementTree escapes markup itself)."""
    s = _XML_BAD.sub("\ufffd", text)
    return s if len(s) <= limit else s[:limit] + "…"


def h(text: object) -> str:
    """HTML text or attribute value (always emitted inside double quotes)."""
    return html.escape(visible(str(text)), quote=True)
