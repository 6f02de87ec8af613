"""Token ids -> the text a client sees: streamed UTF-8, reasoning split from content, stop strings.

Stop strings are matched on the content text; text that could still be the start of a stop string is held back until
it is known not to be one, so a client never sees a stop string or a piece of one.
"""
from __future__ import annotations

from strata.sched.request import Delta

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class TextOutput:
    def __init__(self, tokenizer, prompt_ids, stop: tuple[str, ...], reasoning: bool):
        self.decoder = tokenizer.decode_stream(skip_special_tokens=True, prompt_ids=tuple(prompt_ids)[-8:])
        self.think_open = tokenizer.token_to_id(THINK_OPEN)
        self.think_close = tokenizer.token_to_id(THINK_CLOSE)
        self.stop = tuple(s for s in stop if s)
        self.reasoning = reasoning
        self.pending = ""            # content held back: it may be the start of a stop string
        self.content = ""            # all content emitted so far
        self.stopped = False

    def push(self, token: int) -> Delta:
        """The text this token completes (nothing once a stop string was found)."""
        if self.stopped:
            return Delta()
        if token == self.think_open or token == self.think_close:
            flushed = self._route(self.decoder.flush())
            self.reasoning = token == self.think_open
            return flushed
        return self._route(self.decoder.push(token))

    def finish(self) -> Delta:
        """At the end of generation: whatever the decoder and the stop matcher still hold."""
        if self.stopped:
            return Delta()
        d = self._route(self.decoder.flush())
        tail, self.pending = self.pending, ""
        self.content += tail
        return Delta(content=d.content + tail, reasoning=d.reasoning)

    def _route(self, text: str) -> Delta:
        if not text:
            return Delta()
        if self.reasoning:
            return Delta(reasoning=text)
        return Delta(content=self._match_stop(text))

    def _match_stop(self, text: str) -> str:
        if not self.stop:
            self.content += text
            return text
        buf = self.pending + text
        hits = [i for i in (buf.find(s) for s in self.stop) if i >= 0]
        if hits:
            out = buf[:min(hits)]
            self.pending, self.stopped = "", True
        else:
            hold = max((k for s in self.stop for k in range(1, min(len(s), len(buf) + 1))
                        if buf.endswith(s[:k])), default=0)
            out, self.pending = buf[:len(buf) - hold], buf[len(buf) - hold:]
        self.content += out
        return out
