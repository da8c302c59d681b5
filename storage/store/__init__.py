"""Where bytes live: the Store and its backends."""
