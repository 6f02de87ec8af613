"""max_context auto (strata/experts/planner.py auto_context): the model's positions, capped where the device does not
report its free memory, else lowered until the sequence state takes at most half of the room; one plan line."""
from __future__ import annotations

from strata.experts.planner import GIB, MIB, auto_context

SHAPE = dict(cap=32768, reserve_mib=0, work_bytes=0, fixed_state_bytes=0, pad=512, sequences=3)


def test_no_free_memory_figure_caps_at_the_default():
    n, line = auto_context(1 << 20, None, token_state_bytes=3 * 24 * 1024, **SHAPE)
    assert n == 32768
    assert line == ("strata plan: max_context 32768 (auto): the model supports 1048576 positions, capped at 32768 "
                    "(the device does not report its free memory)")
    assert auto_context(4096, None, token_state_bytes=1, **SHAPE) == (4096, "strata plan: max_context 4096 (auto): "
                                                                            "the model supports 4096 positions")


def test_the_state_takes_at_most_half_of_the_room():
    per_token = 3 * 24 * 1024                   # three sequences of 24 KB of KV a token
    free = 16 * GIB
    n, line = auto_context(1 << 20, free, token_state_bytes=per_token, **dict(SHAPE, reserve_mib=1024,
                                                                             fixed_state_bytes=64 * MIB))
    room = free - 1024 * MIB
    assert n % 1024 == 0 and 64 * MIB + (n + 512) * per_token <= room // 2
    assert 64 * MIB + (n + 1024 + 512) * per_token > room // 2          # the largest multiple of 1024 that fits
    assert line.startswith(f"strata plan: max_context {n} (auto): the model supports 1048576 positions; 3 sequence "
                           f"states of {n} tokens take ")
    assert "at most half of the 15.00 GiB left beside the reserve and working buffers" in line
    # a model whose positions fit is given them all
    assert auto_context(65536, free, token_state_bytes=per_token, **SHAPE)[0] == 65536
