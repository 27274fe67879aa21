"""Each message a device sends in a secure round, held to the protocol before it counts.

A check that fails raises `ProtocolError` naming the device: the protocol can tell who lied.
"""

from __future__ import annotations

from coordinator.stages.secure.state import Reveals, RoundState
from protocols import secure_aggregation as sa
from protocols.errors import ProtocolError
from protocols.messages import SecAggKeys, SecAggReveal, SecAggShares


def checked_keys(message: SecAggKeys, state: RoundState) -> SecAggKeys:
    """Both public keys are usable: one low-order key would stop every neighbour dealing."""
    for key in (message.channel_key, message.mask_key):
        problem = sa.public_key_problem(key)
        if problem:
            raise ProtocolError(problem, device_id=message.device_id, round_id=state.round_id)
    if message.channel_key == message.mask_key:
        msg = "the same key for sealing and masking: revealing one would open the other"
        raise ProtocolError(msg, device_id=message.device_id, round_id=state.round_id)
    return message


def checked_shares(message: SecAggShares, state: RoundState) -> SecAggShares:
    """A dealer's shares go to exactly its neighbours; their commitments are kept."""
    dealer = message.device_id
    holders = [s.holder for s in message.shares]
    if sorted(holders) != sorted(state.neighbours.get(dealer, ())):
        msg = "shares not dealt to exactly this device's neighbours"
        raise ProtocolError(msg, device_id=dealer, round_id=state.round_id)
    for sealed in message.shares:
        pair = (dealer, sealed.holder)
        state.commitments[pair] = (sealed.seed_share_commitment, sealed.key_share_commitment)
    return message


def recoverable(shares: dict[str, SecAggShares], state: RoundState) -> tuple[str, ...]:
    """The dealers whose secrets enough dealing neighbours hold (U2), to a fixed point."""
    dealers = set(shares)
    while True:
        kept = {d for d in dealers if len(set(state.neighbours[d]) & dealers) >= state.threshold(d)}
        if kept == dealers:
            return tuple(sorted(kept))
        dealers = kept


def checked_reveal(message: SecAggReveal, state: RoundState) -> Reveals:
    """Each revealed share is one the holder was dealt, of the right secret, as committed."""
    holder = message.device_id
    dealers, survivors = set(state.dealers), set(state.survivors)
    out: Reveals = {}
    for revealed in message.shares:
        dealer = revealed.dealer
        wanted: sa.SealedKind = "seed" if dealer in survivors else "key"
        commitment = state.commitments.get((dealer, holder))
        if dealer not in dealers or commitment is None or (dealer, wanted) in out:
            msg = f"revealed a share of {dealer} it was not dealt (or twice)"
            raise ProtocolError(msg, device_id=holder, round_id=state.round_id)
        if revealed.secret != wanted:
            msg = f"revealed {dealer}'s {revealed.secret} share, the unmasking asks its {wanted}"
            raise ProtocolError(msg, device_id=holder, round_id=state.round_id)
        share, salt = bytes.fromhex(revealed.share), bytes.fromhex(revealed.salt)
        expected = commitment[0] if wanted == "seed" else commitment[1]
        actual = sa.share_commitment(state.context, dealer, holder, wanted, share, salt)
        if not sa.constant_time_equal(actual, expected):
            msg = f"revealed a share of {dealer} other than the one dealt to it"
            raise ProtocolError(msg, device_id=holder, round_id=state.round_id)
        out[(dealer, wanted)] = (state.points[holder], share)
    return out
