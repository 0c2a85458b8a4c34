"""Escaping of hostile strings, one function per medium. Pure."""

from __future__ import annotations

import html
import re
import unicodedata

from runner.termsafe import _ESCAPED_CATEGORIES

# XML 1.0 forbids these even as character references.
_XML_BAD = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff\ud800-\udfff]")
# Every value sits mid-line (after "- x: " or in a table cell), so only inline syntax
# needs escaping; '<', '>' and '&' are already entities.
_MD_SPECIAL = re.compile(r"([\\`*_{}\[\]()|~!])")
# GitHub turns bare "scheme:..." and "www." text into links (GFM autolinks, matched by the
# Markdown parser on the raw text): every ':' and the '.' after "www" become character
# references, which render the same but link nothing.
_WWW_DOT = re.compile(r"(?i)(?<![a-z0-9])(www)\.")
# Mentions (@user, @org/team) and references (#12, owner/repo#12, GH-12) are found later,
# in the rendered HTML's text, where a character reference is already decoded: "&#64;"
# still notifies (github/cmark-gfm#181, openjdk/skara#1548). A zero-width space after the
# '@', the '#' and "GH-" breaks them there and renders as nothing.
_ZWSP = "\u200b"
_HASH = re.compile(r"(?<!&)#")  # not the '#' of a character reference html.escape wrote
_GH_REF = re.compile(r"(?i)(?<![a-z0-9])(gh-)(?=[0-9])")
# A value that opens a list item ("- {value}": the report's improved/regressed cases) and
# starts like a list marker would open a nested list there: "- 1. t0 ..." for the valid
# case id "1.", "- - x" or "- + x". The marker's punctuation is backslash-escaped.
_LEADING_MARKER = re.compile(r"^(\d{1,9}(?=[.)])|(?=[-+]))")


def _shown(ch: str) -> str:
    if ch in "\n\t" or unicodedata.category(ch) not in _ESCAPED_CATEGORIES:
        return ch
    n = ord(ch)
    return f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}"


def visible(text: str) -> str:
    """Controls and format characters (runner.termsafe's categories: Cc, Cf, Cs, Zl, Zp,
    so bidi, zero-width, tag characters, BOM, soft hyphen) shown as \\uXXXX or
    \\UXXXXXXXX; tabs kept, newlines kept."""
    return "".join(_shown(ch) for ch in text)


def one_line(text: str, limit: int = 300) -> str:
    """Visible, newlines folded to ' / ', capped: for terminal cells and Markdown."""
    flat = visible(text).replace("\r\n", "\n").replace("\n", " / ").replace("\t", " ")
    return flat if len(flat) <= limit else flat[:limit] + "…"


def md(text: str, limit: int = 300) -> str:
    """Inert Markdown inline text: HTML-escaped, punctuation backslash-escaped, no
    autolinks (``:`` and ``www.`` as character references), no @mentions nor issue
    references (a zero-width space after ``@``, ``#`` and ``GH-``), no list marker at its
    start, one line (safe inside a table cell and after ``- ``)."""
    s = html.escape(one_line(text, limit), quote=True)
    s = _GH_REF.sub(r"\1" + _ZWSP, _HASH.sub("#" + _ZWSP, s).replace("@", "@" + _ZWSP))
    s = _LEADING_MARKER.sub(r"\1\\", _MD_SPECIAL.sub(r"\\\1", s))
    return _WWW_DOT.sub(r"\1&#46;", s.replace(":", "&#58;"))


def xml(text: str, limit: int = 4000) -> str:
    """Text that is valid in XML 1.0 (ElementTree escapes markup itself) and shows what
    it holds: controls and format characters as escapes (:func:`visible`: C1 controls,
    bidi overrides, zero-width and line separators are legal XML, and a CI page renders
    them), anything XML cannot hold replaced."""
    s = _XML_BAD.sub("\ufffd", visible(text))
    return s if len(s) <= limit else s[:limit] + "…"


def h(text: object) -> str:
    """HTML text or attribute value (always emitted inside double quotes)."""
    return html.escape(visible(str(text)), quote=True)
