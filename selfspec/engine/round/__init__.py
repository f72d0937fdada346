"""One round: plan -> draft -> forward -> verify + commit -> observe."""
