"""Turn a user's file into the plain text that goes into the prompt.

Qt-free and torch-free on purpose: the chat window, the CLI and the tests all
call `load_document` and get either a `Document` or a `DocumentError` whose
message names the file, the problem and the fix.
"""
from __future__ import annotations

import io
import os
import re
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

from engine.errors import DocumentError

KINDS = {".txt": "text", ".md": "markdown", ".markdown": "markdown",
         ".pdf": "pdf", ".html": "html", ".htm": "html"}
SUPPORTED = "plain text (.txt), Markdown (.md), PDF (.pdf) or HTML (.html)"


@dataclass(frozen=True)
class Document:
    path: Path
    name: str          # file name for display
    kind: str          # "text" | "markdown" | "pdf" | "html"
    text: str          # the plain text that goes into the prompt
    pages: int | None  # pdf page count, else None
    encoding: str = "UTF-8"   # how the file's bytes were read (text kinds): UTF-8, UTF-16, Windows-1252, Latin-1


def load_document(path: str | os.PathLike, max_bytes: int = 64 * 2**20) -> Document:
    """Read `path` and return its text; raise DocumentError with a readable message."""
    path = Path(path)
    if not path.exists():
        raise DocumentError(f"{path}: file not found. Check the path and try again.")
    if path.is_dir():
        raise DocumentError(f"{path} is a directory, not a file. Choose a single document.")
    size = path.stat().st_size
    if size > max_bytes:
        raise DocumentError(
            f"{path.name} is {size / 2**20:.1f} MB, larger than the {max_bytes / 2**20:.1f} MB "
            "limit. Split it or load a shorter excerpt.")
    try:
        data = path.read_bytes()
    except OSError as e:  # permissions, or a file that vanished / is locked
        raise DocumentError(f"{path.name} could not be read ({e.strerror or e}). "
                            "Check the file's permissions.") from e

    kind = KINDS.get(path.suffix.lower(), "text")  # unknown extensions: try as text
    pages, encoding = None, "UTF-8"
    if kind == "pdf":
        text, pages = _pdf_text(path, data)
    else:
        text, encoding = _decode(path, data)
        if kind == "html":
            text = _html_text(text)
    text = _normalise(text)
    if not text.strip():
        raise DocumentError(f"{path.name} is empty (or only whitespace). "
                            "Choose a file that contains text.")
    return Document(path=path, name=path.name, kind=kind, text=text, pages=pages, encoding=encoding)


def _decode(path: Path, data: bytes) -> tuple[str, str]:
    """-> (text, the encoding it was read in). UTF-8 (with or without BOM) and BOM-marked UTF-16 first; bytes that
    are not UTF-8 but look like text (no NUL, hardly any control characters) are the old 8-bit encodings most
    documents were written in: Windows-1252 (Latin-1 where it has no character). Anything else is binary."""
    if data.startswith(b"\xef\xbb\xbf"):
        candidates = [("utf-8-sig", "UTF-8")]
    elif data.startswith((b"\xff\xfe", b"\xfe\xff")):
        candidates = [("utf-16", "UTF-16")]  # the BOM tells Python the byte order
    else:
        candidates = [("utf-8", "UTF-8")]
        if b"\x00" not in data and _mostly_text(data):
            candidates += [("cp1252", "Windows-1252"), ("latin-1", "Latin-1")]
    for codec, name in candidates:
        try:
            text = data.decode(codec)
        except UnicodeDecodeError:
            continue
        if "\x00" not in text:              # NUL characters never occur in real text
            return text, name
    raise DocumentError(
        f"{path.name} looks binary (it is not UTF-8, UTF-16, Windows-1252 or Latin-1 text). "
        f"Supported kinds: {SUPPORTED}; convert the file to one of them.")


def _mostly_text(data: bytes) -> bool:
    """Under 1% control characters other than tab, newline, form feed and carriage return."""
    controls = sum(1 for c in data if c < 32 and c not in (9, 10, 12, 13))
    return controls <= len(data) // 100


def _pdf_text(path: Path, data: bytes) -> tuple[str, int]:
    """Text of every page joined with blank lines, plus the page count."""
    from pypdf import PdfReader  # imported here so text-only use never pays for it

    if not data.strip():
        return "", 0  # reported as empty by the caller
    try:
        reader = PdfReader(io.BytesIO(data))
        if reader.is_encrypted and not reader.decrypt(""):
            raise DocumentError(f"{path.name} is password-protected. "
                                "Save an unprotected copy and load that.")
        texts = [page.extract_text() or "" for page in reader.pages]
    except DocumentError:
        raise
    except Exception as e:  # pypdf raises many types for damaged files
        raise DocumentError(f"The PDF {path.name} could not be read ({e}). It may be damaged; "
                            "re-export it or copy its text into a .txt file.") from e
    if not "".join(texts).strip():
        raise DocumentError(
            f"{path.name} has no extractable text: it may be a scanned image. "
            "Run it through OCR first, or paste its text into a .txt file.")
    return "\n\n".join(t.strip("\n") for t in texts), len(texts)


# Elements whose content is never shown, and elements that start a new line/paragraph.
_HIDDEN = {"script", "style", "head", "title", "noscript", "template"}
_BLOCK = {"p", "div", "section", "article", "header", "footer", "main", "nav", "aside",
          "h1", "h2", "h3", "h4", "h5", "h6", "ul", "ol", "li", "table", "tr", "pre",
          "blockquote", "figure", "figcaption", "dl", "dt", "dd", "hr", "form", "body"}


class _TextExtractor(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)  # turns &amp; etc. into characters
        self.parts: list[str] = []
        self.hidden = 0  # depth inside script/style/head
        self.pre = 0     # depth inside <pre>, where whitespace is kept

    def handle_starttag(self, tag, attrs):
        if tag == "body":
            self.hidden = 0  # a <head> left unclosed must not hide the whole page
        if tag in _HIDDEN:
            self.hidden += 1
        elif tag == "br":
            self.parts.append("\n")
        elif tag in _BLOCK:
            self.pre += tag == "pre"
            self.parts.append("\n\n")

    def handle_endtag(self, tag):
        if tag in _HIDDEN:
            self.hidden = max(0, self.hidden - 1)
        elif tag in _BLOCK:
            self.pre = max(0, self.pre - (tag == "pre"))
            self.parts.append("\n\n")
        elif tag in ("td", "th"):
            self.parts.append("\t")  # keep table cells apart

    def handle_data(self, data):
        if self.hidden:
            return
        if not self.pre:  # outside <pre>, any run of whitespace is one space
            data = re.sub(r"\s+", " ", data)
            if not self.parts or self.parts[-1].endswith("\n"):
                data = data.lstrip()  # no leading space at the start of a line
        if data:
            self.parts.append(data)


def _html_text(source: str) -> str:
    parser = _TextExtractor()
    parser.feed(source)
    parser.close()
    lines = [line.rstrip() for line in "".join(parser.parts).split("\n")]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip("\n") + "\n"


def _normalise(text: str) -> str:
    """Newlines to \\n and no trailing whitespace on any line; nothing else changes."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    return "\n".join(line.rstrip() for line in text.split("\n"))
