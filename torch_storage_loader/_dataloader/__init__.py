"""The DataLoader side: the delivery ledger (``ledger``, no torch), every private torch touch (``hooks``),
and the Lightning train loader whose checkpointed state is what the model consumed (``consumed``)."""
