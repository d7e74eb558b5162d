"""The DataLoader side: ``StorageDataset``'s finite and streaming sides (``finite``, ``stream``) and its
items (``items``), the delivery ledger (``ledger``, no torch), every private torch touch (``hooks``),
and the Lightning train loader whose checkpointed state is what the model consumed (``consumed``)."""
