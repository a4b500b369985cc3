"""How a document and a question become chat messages. The document comes first and unchanged, so a
second question about the same document shares its KV blocks through the prefix cache."""
from __future__ import annotations


def document_messages(document: str, question: str, name: str = "document",
                      system: str | None = None, history: list[dict] | None = None) -> list[dict]:
    intro = (f"Read the document below ({name}) and answer questions about it.\n\n"
             f"<document>\n{document}\n</document>")
    messages = [{"role": "system", "content": system}] if system else []
    turns = list(history or [])
    if turns:  # the document rides in the first user turn; later turns are plain
        first = dict(turns[0])
        first["content"] = f"{intro}\n\n{first['content']}"
        turns[0] = first
        return messages + turns + [{"role": "user", "content": question}]
    return messages + [{"role": "user", "content": f"{intro}\n\nQuestion: {question}"}]
