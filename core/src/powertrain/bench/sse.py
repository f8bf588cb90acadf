"""An incremental server-sent-events reader for the bytes of a streamed response.

Network reads split a stream anywhere: inside a line, between `\\r` and `\\n`, inside a
multi-byte UTF-8 character. Parsing the raw bytes here (rather than trusting a line
iterator) keeps the token timestamps honest and makes those cases testable.
"""

from __future__ import annotations

import codecs


class SSEParser:
    """Feed byte chunks; get back the `data` of each event completed so far.

    Follows the event-stream format: lines end with CRLF, LF or CR; `:` starts a
    comment; an event's `data:` lines are joined by newlines; a blank line ends the event.
    Other fields (`event:`, `id:`, `retry:`) are ignored: OpenAI streams use data only.
    """

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")()
        self._buffer = ""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        self._buffer += self._decoder.decode(chunk)
        return self._drain(final=False)

    def close(self) -> list[str]:
        """End of stream: an event not yet ended by a blank line still counts."""
        self._buffer += self._decoder.decode(b"", final=True)
        events = self._drain(final=True)
        if self._buffer:
            self._line(self._buffer, events)
            self._buffer = ""
        if self._data:
            events.append("\n".join(self._data))
            self._data = []
        return events

    def _drain(self, final: bool) -> list[str]:
        events: list[str] = []
        start = 0
        buffer = self._buffer
        while True:
            cr, lf = buffer.find("\r", start), buffer.find("\n", start)
            end = min(i for i in (cr, lf) if i >= 0) if cr >= 0 or lf >= 0 else -1
            if end < 0:
                break
            if buffer[end] == "\r" and end + 1 == len(buffer) and not final:
                break  # a CR at the end may be the first half of CRLF: wait for the next chunk
            self._line(buffer[start:end], events)
            start = end + (2 if buffer.startswith("\r\n", end) else 1)
        self._buffer = buffer[start:]
        return events

    def _line(self, line: str, events: list[str]) -> None:
        if not line:
            if self._data:
                events.append("\n".join(self._data))
                self._data = []
            return
        if line.startswith(":"):
            return
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
