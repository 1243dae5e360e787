"""Engine integrations built on the lmcache_mp client (each imports its engine lazily)."""
