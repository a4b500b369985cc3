"""app.documents: each supported kind loads, and each bad file gives a clear DocumentError."""
import os
import sys

import pytest

from app.documents import Document, load_document
from engine.errors import DocumentError


def make_pdf(page_texts: list[str]) -> bytes:
    """A minimal valid PDF, one page per string, text set in Type1 Helvetica.

    Objects: 1 catalog, 2 page tree, 3 font, then a (page, content stream) pair per page.
    The xref table holds each object's byte offset, so the file is well-formed.
    """
    n = len(page_texts)
    page_ids = [4 + 2 * i for i in range(n)]
    objects = {
        1: b"<< /Type /Catalog /Pages 2 0 R >>",
        2: b"<< /Type /Pages /Kids [" + b" ".join(b"%d 0 R" % p for p in page_ids)
           + b"] /Count %d >>" % n,
        3: b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
    }
    for pid, text in zip(page_ids, page_texts):
        stream = b"BT /F1 12 Tf 72 720 Td (" + text.encode("latin-1") + b") Tj ET"
        objects[pid] = (b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] "
                        b"/Resources << /Font << /F1 3 0 R >> >> /Contents %d 0 R >>" % (pid + 1))
        objects[pid + 1] = b"<< /Length %d >>\nstream\n" % len(stream) + stream + b"\nendstream"

    out = bytearray(b"%PDF-1.4\n")
    offsets = {}
    for num in sorted(objects):
        offsets[num] = len(out)
        out += b"%d 0 obj\n" % num + objects[num] + b"\nendobj\n"
    xref_at = len(out)
    size = max(objects) + 1
    out += b"xref\n0 %d\n" % size + b"0000000000 65535 f \n"
    for num in range(1, size):
        out += b"%010d 00000 n \n" % offsets[num]
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (size, xref_at)
    return bytes(out)


def write(tmp_path, name, data):
    path = tmp_path / name
    path.write_bytes(data if isinstance(data, bytes) else data.encode("utf-8"))
    return path


def error_for(path, **kwargs) -> str:
    with pytest.raises(DocumentError) as info:
        load_document(path, **kwargs)
    return str(info.value)


# --- supported kinds ----------------------------------------------------------------------

def test_text_round_trips(tmp_path):
    body = "Line one\n\n  indented line two\nüñïçødé ✓\n"
    doc = load_document(write(tmp_path, "notes.txt", body))
    assert doc == Document(path=tmp_path / "notes.txt", name="notes.txt", kind="text",
                           text=body, pages=None)


def test_markdown_kept_as_is(tmp_path):
    body = "# Title\n\n- item *one*\n- item `two`\n\n```py\nx = 1\n```\n"
    for name in ("a.md", "b.markdown"):
        doc = load_document(write(tmp_path, name, body))
        assert doc.kind == "markdown" and doc.text == body and doc.pages is None


def test_newlines_normalised_and_trailing_spaces_stripped(tmp_path):
    doc = load_document(write(tmp_path, "win.txt", b"a  \r\nb\t\r\rc  d \r\n"))
    assert doc.text == "a\nb\n\nc  d\n"


def test_pdf_text_extracted(tmp_path):
    doc = load_document(write(tmp_path, "hello.pdf", make_pdf(["Hello kvscope"])))
    assert doc.kind == "pdf" and doc.pages == 1
    assert "Hello kvscope" in doc.text


def test_pdf_pages_joined_with_blank_line(tmp_path):
    doc = load_document(write(tmp_path, "two.PDF", make_pdf(["First page", "Second page"])))
    assert doc.pages == 2
    first, second = doc.text.split("\n\n")
    assert "First page" in first and "Second page" in second


def test_html_drops_scripts_styles_head_and_unescapes(tmp_path):
    html = """<!doctype html>
<html><head><title>Hidden title</title>
<style>body { color: red; }</style></head>
<body>
  <script>var secret = 1;</script>
  <h1>Fish &amp; Chips</h1>
  <p>First   paragraph
     wraps here.</p>
  <p>Second<br>line &lt;b&gt; &#169;</p>
  <ul><li>one</li><li>two</li></ul>
</body></html>"""
    doc = load_document(write(tmp_path, "page.html", html))
    assert doc.kind == "html" and doc.pages is None
    for gone in ("Hidden title", "color", "secret", "<h1>", "&amp;"):
        assert gone not in doc.text
    assert doc.text == ("Fish & Chips\n\nFirst paragraph wraps here.\n\n"
                        "Second\nline <b> \u00a9\n\none\n\ntwo\n")


def test_html_without_closing_head_still_shows_body(tmp_path):
    doc = load_document(write(tmp_path, "sloppy.htm", "<head><title>t</title><body><p>Body text"))
    assert doc.text.strip() == "Body text"


def test_utf16_and_utf8_bom_decode(tmp_path):
    body = "Grüße aus UTF-16\nzweite Zeile\n"
    for name, data in (("le.txt", body.encode("utf-16")),            # BOM + native order
                       ("be.txt", b"\xfe\xff" + body.encode("utf-16-be")),
                       ("bom.md", body.encode("utf-8-sig"))):
        assert load_document(write(tmp_path, name, data)).text == body


def test_old_8bit_encodings_are_read_and_named(tmp_path):
    """Most old documents are Latin-1 or Windows-1252: read, and the encoding reported; real binary is not."""
    latin = load_document(write(tmp_path, "latin.txt", "caf\u00e9 \u00e9t\u00e9, na\u00efve\n".encode("latin-1")))
    assert latin.text == "caf\u00e9 \u00e9t\u00e9, na\u00efve\n" and latin.encoding == "Windows-1252"
    quotes = "\u201cQuoted\u201d \u2013 \u20ac5\n"                           # curly quotes, en dash, euro sign
    win = load_document(write(tmp_path, "win.md", quotes.encode("cp1252")))
    assert win.text == quotes and win.encoding == "Windows-1252"
    odd = load_document(write(tmp_path, "odd.txt", b"x \x81 y\n"))         # no character in Windows-1252
    assert odd.text == "x \x81 y\n" and odd.encoding == "Latin-1"
    assert load_document(write(tmp_path, "u.txt", "Gr\u00fc\u00dfe\n")).encoding == "UTF-8"
    assert load_document(write(tmp_path, "w.txt", "Gr\u00fc\u00dfe\n".encode("utf-16"))).encoding == "UTF-16"
    junk = bytes(range(1, 32)) * 20 + "caf\u00e9".encode("latin-1")             # control bytes: not text
    assert "binary" in error_for(write(tmp_path, "junk.dat", junk))


def test_unknown_extension_read_as_text(tmp_path):
    doc = load_document(write(tmp_path, "script.py", "print('hi')\n"))
    assert doc.kind == "text" and doc.text == "print('hi')\n"


def test_accepts_str_path(tmp_path):
    assert load_document(str(write(tmp_path, "s.txt", "x"))).text == "x"


# --- errors --------------------------------------------------------------------------------

def test_missing_file(tmp_path):
    assert "not found" in error_for(tmp_path / "nope.txt")


def test_directory(tmp_path):
    assert "directory" in error_for(tmp_path)


def test_too_large_names_both_sizes(tmp_path):
    path = write(tmp_path, "big.txt", b"a" * (3 * 2**20))
    msg = error_for(path, max_bytes=2**20)
    assert "big.txt" in msg and "3.0 MB" in msg and "1.0 MB" in msg


@pytest.mark.parametrize("data", [b"", b"   \n\t\r\n  "])
def test_empty_or_whitespace(tmp_path, data):
    msg = error_for(write(tmp_path, "blank.txt", data))
    assert "blank.txt" in msg and "empty" in msg


def test_empty_html_is_empty(tmp_path):
    assert "empty" in error_for(write(tmp_path, "e.html", "<html><script>x</script></html>"))


@pytest.mark.parametrize("name,data", [
    ("nul.txt", b"text\x00with nul"),
    ("image.png", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR"),
    ("utf16-nobom.txt", "no bom".encode("utf-16-le")),
])
def test_binary(tmp_path, name, data):
    msg = error_for(write(tmp_path, name, data))
    assert name in msg and "binary" in msg and ".pdf" in msg and ".md" in msg


def test_corrupt_pdf(tmp_path):
    msg = error_for(write(tmp_path, "bad.pdf", b"%PDF-1.4\nthis is not really a pdf\n"))
    assert "bad.pdf" in msg and "could not be read" in msg


def test_truncated_pdf(tmp_path):
    msg = error_for(write(tmp_path, "cut.pdf", make_pdf(["Hello kvscope"])[:120]))
    assert "could not be read" in msg or "OCR" in msg


def test_pdf_without_text_needs_ocr(tmp_path):
    msg = error_for(write(tmp_path, "scan.pdf", make_pdf([""])))
    assert "scan.pdf" in msg and "scanned image" in msg and "OCR" in msg


@pytest.mark.skipif(sys.platform == "win32" or os.geteuid() == 0,
                    reason="permissions are not enforced for root / on Windows")
def test_unreadable(tmp_path):
    path = write(tmp_path, "secret.txt", "hidden")
    path.chmod(0)
    try:
        assert "permissions" in error_for(path)
    finally:
        path.chmod(0o644)


def test_unreadable_simulated(tmp_path, monkeypatch):
    """Same as above, but works as root: make read_bytes fail the way a chmod 000 file does."""
    path = write(tmp_path, "locked.txt", "hidden")

    def deny(self):
        raise PermissionError(13, "Permission denied", str(self))
    monkeypatch.setattr(type(path), "read_bytes", deny)
    msg = error_for(path)
    assert "locked.txt" in msg and "Permission denied" in msg and "permissions" in msg


def test_module_stays_qt_and_torch_free():
    """documents.py (and engine.errors) import no Qt, no torch, and pypdf only when needed."""
    import subprocess
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = ("import sys, app.documents; "
            "bad = [m for m in ('PySide6', 'pyqtgraph', 'torch', 'pypdf') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)
