"""Building blocks the model files assemble: norm, rotary, activation, attention, indexer.

Each module holds one concern and plain torch, so a kernel pack can see exactly
what it would replace. Nothing here goes through pluggy (DESIGN §2).
"""
