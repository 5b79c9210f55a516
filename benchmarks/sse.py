"""The JSON events of vLLM's streaming responses, split into lines as the SSE standard says.

httpx's ``aiter_lines`` splits like ``str.splitlines``: also at U+0085, U+2028 and
U+2029, which vLLM writes unescaped inside its JSON where a sampled token holds one (a
temperature 1.0 server benchmark broke on it). SSE ends lines only at CR, LF or CRLF,
which JSON always escapes inside strings.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator

_LINE_END = re.compile(r"\r\n|\r|\n")
_DATA = "data: "


async def data_events(response) -> AsyncIterator[dict]:
    """Each ``data:`` event's JSON in a streaming httpx response, ``[DONE]`` left out."""
    pending = ""
    async for text in response.aiter_text():
        *lines, pending = _LINE_END.split(pending + text)
        for event in _events(lines):
            yield event
    for event in _events([pending]):  # a last line without its line end
        yield event


def _events(lines: list[str]) -> list[dict]:
    return [json.loads(line[len(_DATA):]) for line in lines
            if line.startswith(_DATA) and line != _DATA + "[DONE]"]
