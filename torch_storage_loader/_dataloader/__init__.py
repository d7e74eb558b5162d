"""The DataLoader side: the delivery ledger (``ledger``, no torch) and every private torch touch (``hooks``)."""
