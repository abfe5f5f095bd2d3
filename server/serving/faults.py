"""Fault injection, for tests only (setting inject_faults, refused unless the server listens on
loopback): a marker in a prompt makes a call fail where a device fault would, since CPU-only
machines cannot produce real ones on demand. A fake at that boundary, off by default.

    [[fail]]   the step raises (RuntimeError)         [[oom]]    the step runs out of memory
    [[hang]]   the step never returns (until close)   [[decode]] the VAE decode raises
    [[kill]]   the step loop thread dies              [[slow]]   the step takes twice its deadline
    [[kill-worker]]  a helper thread of the lane (a sequence group's rank) dies in the step
    [[slow-encode]]  a video job's encode takes SLOW_ENCODE_S longer (longer than a short lease)
"""

from __future__ import annotations

import threading
from typing import Any

import torch

FAULT_STEP = 2  # the step at which a marked request's batch fails


class LoopKilled(BaseException):
    """Escapes every `except Exception`, as a crash of the loop thread would."""


STEP_FAULTS = {"[[fail]]": RuntimeError, "[[oom]]": torch.OutOfMemoryError, "[[kill]]": LoopKilled}


SLOW = 2.0  # [[slow]]: the step takes this many times its deadline (slow, not stuck)
SLOW_ENCODE_S = 8.0  # [[slow-encode]]: added to a video's encode (past the 5 s a stop always allows)


def slow_encode(prompt: str) -> None:
    """`[[slow-encode]]`: the encode of a long clip, which outlasts a lease, in a tiny one."""
    if "[[slow-encode]]" in prompt:
        threading.Event().wait(SLOW_ENCODE_S)


def inject_fault(
    call: str, states: list, closed: threading.Event, deadline_s: float, workers: Any = None
) -> None:
    """Raise (or block) if a marked request takes part in `call` ("start", "step" or "decode");
    `workers`: the lane's helper threads (`Workers`), one of which `[[kill-worker]]` kills."""
    for state in states:
        prompt = getattr(getattr(state, "request", state), "prompt", "")
        if call == "step" and state.index == FAULT_STEP and "[[kill-worker]]" in prompt and workers:
            workers.kill_next()
        if call == "step" and state.index == FAULT_STEP:
            for marker, error in STEP_FAULTS.items():
                if marker in prompt:
                    raise error(f"injected fault {marker}")
            if "[[hang]]" in prompt:
                closed.wait()  # wedged until the loop closes
            if "[[slow]]" in prompt:
                closed.wait(SLOW * deadline_s)  # past its deadline, then it returns
        if call == "decode" and "[[decode]]" in prompt:
            raise RuntimeError("injected fault [[decode]]")
