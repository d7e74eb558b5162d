"""Redis helpers for RedisStorageQueue: connection and retries."""
