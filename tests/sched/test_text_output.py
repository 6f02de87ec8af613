"""TextOutput (strata/sched/output.py) on tiny's tokenizer, token by token as the scheduler feeds it: a chat reply's
whitespace-only reasoning block leaves no reasoning and no blank lines before the content, a block with text loses
only its layout whitespace, content indentation stays, and a text completion keeps every byte."""
from __future__ import annotations

import pytest

from strata.builtin import builtin_dir
from strata.sched.output import TextOutput
from strata.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok():
    t = Tokenizer.from_dir(builtin_dir("tiny"))
    # the model writes the tags as single tokens, as the tests' texts encode them
    assert [t.encode("<think>"), t.encode("</think>")] == [[t.token_to_id("<think>")], [t.token_to_id("</think>")]]
    return t


def feed(tok, text: str, chat: bool = True, reasoning: bool = False) -> tuple[str, str]:
    """Each token of `text` pushed in turn -> (reasoning, content) as a client puts them together from the deltas."""
    out = TextOutput(tok, tok.encode("<|im_start|>assistant\n"), (), reasoning, chat)
    ids = tok.encode(text)
    got = [out.push(t) for t in ids] + [out.finish()]
    return "".join(d.reasoning for d in got), "".join(d.content for d in got)


@pytest.mark.parametrize("block", ["<think>\n\n</think>\n\n", "<think></think>", "<think>\n \t\n</think>\n \n"])
def test_a_whitespace_only_think_block_leaves_nothing(tok, block):
    assert feed(tok, block + "A list is a sequence.") == ("", "A list is a sequence.")
    assert feed(tok, block) == ("", "")


def test_a_think_block_with_text_loses_only_its_layout(tok):
    assert feed(tok, "<think>\nfirst\n\nsecond\n</think>\n\nThe answer.\nMore.") == ("first\n\nsecond",
                                                                                    "The answer.\nMore.")
    # the prompt opened the block: the reply starts inside it
    assert feed(tok, "\n\n</think>\n\nok", reasoning=True) == ("", "ok")
    assert feed(tok, "why\n</think>\n\nok", reasoning=True) == ("why", "ok")


def test_content_keeps_its_indentation_and_inner_blank_lines(tok):
    assert feed(tok, "<think>\n\n</think>\n\n    x = 1\n\n\ny") == ("", "    x = 1\n\n\ny")
    # no think block: content is the model's own, leading blank lines included
    assert feed(tok, "\n\nplain") == ("", "\n\nplain")
    # content before a block is not trimmed, nor what follows it
    assert feed(tok, "a<think>\n\n</think>\n\nb") == ("", "a\n\nb")


def test_a_text_completion_keeps_every_byte(tok):
    assert feed(tok, "<think>\n\n</think>\n\nhi", chat=False) == ("\n\n", "\n\nhi")
