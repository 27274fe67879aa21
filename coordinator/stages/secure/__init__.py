"""Secure aggregation on the coordinator: the rounds come in as one masked sum over survivors.

`uplink` is the engine's secure `UplinkPath`; `retry` tries a failed round again or skips it;
`aggregator` runs one attempt's phases and handles what devices send; `checks` holds each
message to the protocol; `unmask` rebuilds the secrets and checks the sum; `bounds` turns the
settings into what a round announces; `state` is one round's protocol state.
"""
