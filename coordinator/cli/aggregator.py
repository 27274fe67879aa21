"""`pfl-coord aggregator`: the command line of one aggregator of the tier."""

from __future__ import annotations

import threading
from typing import Any

from coordinator.cli.options import ConfigOption, VerboseOption, configure_logging, console
from coordinator.tier.process import run_aggregator
from coordinator.tier.settings import AggregatorSettings
from protocols.errors import PflError
from protocols.program_options import exit_with_error, stop_on_signals
from protocols.settings_options import settings_options


@settings_options(AggregatorSettings)
def aggregator(
    flags: dict[str, Any], config: ConfigOption = None, verbose: VerboseOption = False
) -> None:
    """Serve one group of devices: check and sum their updates, send one partial per round.

    The coordinator runs with --tier-aggregators naming this aggregator. Every flag can also be
    set as a PFL_<NAME> environment variable or in the --config file.
    """
    configure_logging(verbose)
    try:
        settings = AggregatorSettings.load(config, **flags)
        stop = stop_on_signals(threading.Event())
        run_aggregator(
            settings, stop, ready=lambda: console.print(f"aggregator {settings.name} serving")
        )
    except (PflError, ValueError, FileNotFoundError) as error:
        exit_with_error(console, error)
