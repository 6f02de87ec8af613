"""Token ids -> the text a client sees: streamed UTF-8, reasoning split from content, stop strings.

Stop strings are matched on the content text; text that could still be the start of a stop string is held back until
it is known not to be one, so a client never sees a stop string or a piece of one. In a chat reply the whitespace
around a reasoning block's text and the blank lines between `</think>` and the content are the template's layout,
not text: a whitespace-only block leaves no reasoning, and the content starts at its first line with text.
"""
from __future__ import annotations

from strata.sched.request import Delta

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class TextOutput:
    def __init__(self, tokenizer, prompt_ids, stop: tuple[str, ...], reasoning: bool, chat: bool = False):
        self.decoder = tokenizer.decode_stream(skip_special_tokens=True, prompt_ids=tuple(prompt_ids)[-8:])
        self.think_open = tokenizer.token_to_id(THINK_OPEN)
        self.think_close = tokenizer.token_to_id(THINK_CLOSE)
        self.stop = tuple(s for s in stop if s)
        self.reasoning = reasoning
        self.chat = chat             # trim the layout around reasoning blocks (a text completion keeps every byte)
        self.held = ""               # chat: whitespace held back until text follows it in the same part
        self.block_start = reasoning  # chat: no text of the open reasoning block was emitted yet
        self.after_think = False     # chat: a reasoning block closed before any content: its blank lines go
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
            self.held, self.block_start = "", self.reasoning
            self.after_think = self.after_think or (not self.reasoning and not self.content and not self.pending)
            return flushed
        return self._route(self.decoder.push(token))

    def finish(self) -> Delta:
        """At the end of generation: whatever the decoder and the stop matcher still hold (whitespace held at a
        part's edge is layout and goes)."""
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
            return Delta(reasoning=self._trim_reasoning(text) if self.chat else text)
        if self.chat and self.after_think:
            text = self._trim_content(text)
            if not text:
                return Delta()
        return Delta(content=self._match_stop(text))

    def _trim_reasoning(self, text: str) -> str:
        """A reasoning block's text without the whitespace at its start and end (held until text follows)."""
        buf = self.held + text
        if self.block_start:
            buf = buf.lstrip()
        body = buf.rstrip()
        self.held = buf[len(body):]
        self.block_start = self.block_start and not body
        return body

    def _trim_content(self, text: str) -> str:
        """The content after a reasoning block from its first line with text on (held until that text comes)."""
        buf = self.held + text
        if not buf.strip():
            self.held = buf
            return ""
        lead = len(buf) - len(buf.lstrip())
        self.held, self.after_think = "", False
        return buf[buf.rfind("\n", 0, lead) + 1:]

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
