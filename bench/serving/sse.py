"""Incremental decoder for server-sent events (the `text/event-stream` framing of OpenAI streams)."""

from __future__ import annotations

DONE = "[DONE]"


class SSEDecoder:
    """Bytes in, the `data` of each complete event out.

    Lines end in LF or CRLF; a blank line ends an event; several `data:` lines in one
    event are joined with a newline; comments (`:`) and other fields are skipped.
    Bytes may be split anywhere, including inside a UTF-8 character.
    """

    def __init__(self) -> None:
        self._buffer = b""
        self._data_lines: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        self._buffer += chunk
        *lines, self._buffer = self._buffer.split(b"\n")
        events: list[str] = []
        for line in lines:
            event = self._take_line(line.removesuffix(b"\r").decode("utf-8"))
            if event is not None:
                events.append(event)
        return events

    def flush(self) -> list[str]:
        """Events left when the stream closed without the final blank line."""
        events = self.feed(b"\n") if self._buffer else []
        event = self._take_line("")
        return events + ([event] if event is not None else [])

    def _take_line(self, line: str) -> str | None:
        if not line:
            event = "\n".join(self._data_lines) if self._data_lines else None
            self._data_lines = []
            return event
        field, _, value = line.partition(":")
        if field == "data":
            self._data_lines.append(value.removeprefix(" "))
        return None
