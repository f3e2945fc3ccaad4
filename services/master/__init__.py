"""The master: runs and watches `mooncake_master` and reports the pool's capacity, use and evictions."""
