"""Lookup chains `auto` read but did not verify, followed as the row's own tokens arrive.

A context-lookup chain is a fixed guess of the next tokens. Verifying it accepts its longest
prefix that equals what the target commits there (the target's argmax, or its draw at that
position), so once a row has committed those tokens by any rounds (AR ones included), how
much of the chain a verification would have taken is known: exactly at T = 0 and with
reproducible sampling (a draw is keyed by its position), and as a sample of the same
distribution with independent draws. The planner learns from such shadows for nothing: its
lookup calibration gets the evidence of rounds it never ran (a calibration that rated a chain
low had no way to learn otherwise but to bet), and the ledger (`ledger.Ledger.credit`) is
told what the bet it could not afford would have won, which may fund the next lookup bet.

Pure steps over plain lists: `follow` advances one shadow by a round's committed tokens.
Example: chain [4, 9, 9, 2]; AR rounds commit [4], then [9], then [7]: after the third the
shadow ends with 2 tokens accepted (a verification would have taken 4, 9 and added the
target's 7 as its bonus: 3 tokens in one round).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Shadow:
    """One row's unverified chain. `k`: the chain length of the lookup bet the ledger could not
    afford that round (0: none, evidence only); what that bet would have gained is `gain`, this
    row's share of the batch's, once the row's tokens have shown how much of the chain came true."""

    chain: list[int]
    key: tuple  # the lookup calibration's key of the chain (`RowRound.chain_key`)
    k: int = 0
    share: float = 1.0  # 1 / rows of the round it was read in
    spent: float = 0.0  # the bet's predicted time in AR rounds (whole batch)
    seen: int = 0  # chain tokens matched so far
    start: int = 0  # chain tokens a real verification counted already (the rest of an accepted chain)
    credited: bool = False  # the bet's hindsight went to the ledger (once `seen` reached k: its outcome is known)

    def gain(self, accepted: int) -> float:
        """What the bet would have gained, in AR rounds (its row's share): the accepted tokens
        up to k, the bonus, less the row's share of the round's time."""
        return self.share * (min(accepted, self.k) + 1.0 - self.spent)


def follow(chain: list[int], seen: int, committed: list[int]) -> tuple[int, bool]:
    """(tokens of `chain` matched, ended) after `committed` follows the `seen` matched so far:
    ended at the first mismatch or when the whole chain matched.
    Example: follow([4, 9, 2], 1, [9, 7]) -> (2, True); follow([4, 9, 2], 0, [4]) -> (1, False)."""
    for t in committed:
        if seen >= len(chain) or chain[seen] != t:
            return seen, True
        seen += 1
    return seen, seen >= len(chain)
