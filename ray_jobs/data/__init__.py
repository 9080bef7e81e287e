"""Data: staging (validate, tokenize, pack, shard), the node-local shard cache, and reading shards on a worker."""
