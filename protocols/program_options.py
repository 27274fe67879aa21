"""What both programs' commands share: how errors end, how to serve until told.

The data-split flags both programs take are generated from `PartitionSettings`, declared once
(see `protocols.settings_options`).
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType
from typing import NoReturn

import typer
from rich.console import Console
from rich.markup import escape

logger = logging.getLogger(__name__)


def exit_with_error(console: Console, error: BaseException, code: int = 2) -> NoReturn:
    """Print `error:` and the error's own words on one line (no wrapping, no markup), then exit.

    A long message wrapped at the terminal's width reads as two problems; an error naming
    `[brackets]` must not be taken for markup.
    """
    console.print(f"[red]error:[/red] {escape(str(error))}", soft_wrap=True)
    raise typer.Exit(code) from None


def stop_on_signals(stop: threading.Event) -> threading.Event:
    """`stop`, set by SIGTERM or SIGINT when called on the main thread."""
    if threading.current_thread() is threading.main_thread():

        def on_signal(number: int, frame: FrameType | None) -> None:
            del frame
            logger.info("signal %d: stopping", number)
            stop.set()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
    return stop


def wait_for_interrupt() -> None:
    """Block until SIGINT (Ctrl-C) or SIGTERM: for commands that serve until stopped."""
    stop_on_signals(threading.Event()).wait()
