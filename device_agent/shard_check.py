"""An offline export rebuilds the device's data: a shard index alone does not say of what split."""

from __future__ import annotations

from device_agent.settings import AgentSettings


def unsplit_shard_problem(settings: AgentSettings) -> str | None:
    """Why `--data-shard` without `--num-shards` (flag, PFL_NUM_SHARDS or file) is refused.

    The default split (20 shards) is almost never the one the agent ran with; its shard would
    score the exported model on data the device never held, without a word.
    """
    if settings.data_shard is None or "num_shards" in settings.model_fields_set:
        return None
    return (
        f"--data-shard {settings.data_shard} needs --num-shards: give the number of shards "
        "the agent was started with (the default split of "
        f"{AgentSettings.model_fields['num_shards'].default} shards is almost never that one, "
        "and its shard holds other data)"
    )
