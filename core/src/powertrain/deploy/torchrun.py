"""What a process under torchrun needs before anything heavy is imported: whether it is
one, and how it leaves (the CLI asks on every exit, ``--help`` included, so this module
imports nothing but the standard library)."""

from __future__ import annotations

import os
import sys
from typing import NoReturn


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def leave(code: int) -> NoReturn:
    """End a torchrun rank's process once its work is done and its process group destroyed,
    without the interpreter's teardown: there a native thread torch.distributed left
    joinable aborted the process (SIGABRT, "terminate called without an active exception"),
    on rank 1 in 1 of 2 CI runs under load and, once that one left this way, on rank 0."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
