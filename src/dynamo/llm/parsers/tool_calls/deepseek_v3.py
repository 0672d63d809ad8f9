"""DeepSeek V3 / R1-0528 tool calls (special tokens written out in full-width bars):

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>
"""

from __future__ import annotations

import re

from dynamo.llm.parsers.tool_calls.json_calls import JsonCallsParser

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"

_HEAD = re.compile(r"(?:function)?" + re.escape(SEP) + r"([^\n`]+?)[ \t]*\n```(?:json)?[ \t]*\n")


class DeepSeekV3Parser(JsonCallsParser):
    start_markers = (CALLS_BEGIN,)
    region_end = CALLS_END
    skip = (CALL_BEGIN, CALL_END, "```")

    def _call_head(self, buf: str, final: bool) -> tuple[str, int] | bool:
        m = _HEAD.match(buf)
        if m is not None:
            return m.group(1).strip(), m.end()
        if final:
            return False
        # wait while the text can still become a head: "function<｜tool▁sep｜>name\n```json\n"
        if ("function" + SEP).startswith(buf):
            return True
        rest = buf[len("function"):] if buf.startswith("function") else buf
        return rest.startswith(SEP) or SEP.startswith(rest)
