"""One local-update module per algorithm, and the registry that selects them by name."""

from __future__ import annotations

from device_agent.algorithms.base import LocalUpdate
from device_agent.algorithms.ditto import DittoUpdate
from device_agent.algorithms.fedalt import FedAltUpdate
from device_agent.algorithms.fedavg import FedAvgUpdate
from device_agent.algorithms.fedavg_ft import FedAvgFtUpdate
from device_agent.algorithms.federico import FedericoUpdate
from device_agent.algorithms.fedprox import FedProxUpdate
from device_agent.algorithms.fedsim import FedSimUpdate
from device_agent.algorithms.local import LocalOnlyUpdate
from device_agent.algorithms.pfedbred import PFedBreDUpdate, PFedMeUpdate
from device_agent.algorithms.selffl import SelfFlAugUpdate, SelfFlUpdate

LOCAL_UPDATES: dict[str, type[LocalUpdate]] = {
    update.name: update
    for update in (
        LocalOnlyUpdate,
        FedAvgUpdate,
        FedAvgFtUpdate,
        FedProxUpdate,
        FedAltUpdate,
        FedSimUpdate,
        PFedMeUpdate,
        PFedBreDUpdate,
        DittoUpdate,
        SelfFlUpdate,
        SelfFlAugUpdate,
        FedericoUpdate,
    )
}


def build_local_update(name: str) -> LocalUpdate:
    """The device half of algorithm `name`.

    Raises:
        ValueError: unknown algorithm; the message names the valid ones.
    """
    update_type = LOCAL_UPDATES.get(name)
    if update_type is None:
        msg = f"unknown algorithm {name!r}; choose one of: {', '.join(sorted(LOCAL_UPDATES))}"
        raise ValueError(msg)
    return update_type()
